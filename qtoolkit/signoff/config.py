"""What a sign-off is asked, one type per mode: a local sign-off (LocalSignoffConfig), a deployment sign-off
(DeploymentSignoffConfig), and their sweeps (SweepSignoffConfig: recipes, EndpointSweepSignoffConfig: served
candidates). The mode is the type: `qtool signoff` builds exactly one of them from its flags, and a field a mode
never reads is not on its type. Defaults come from defaults.py, as the flags' do. Torch-free (the CLI imports it
to build the configuration before it loads the sign-off).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from . import defaults

# report.json's `config` is the flat record one configuration type held for every mode before each mode had its
# own type: a field a mode does not have is written as that record held it (a deployment never read the engine's
# options), so reports stay comparable across the change and `--rejudge` writes what it wrote before
FLAT_FIELDS = ("model", "recipe", "output", "policy", "limit", "endpoint", "concurrency", "num_requests",
               "mean_output_tokens", "speculative", "kv_cache_dtype", "diagnose_batches", "seed", "rounds",
               "max_rounds", "max_items", "allow_weak_sandbox", "rejudge", "candidate_endpoint", "baseline_endpoint",
               "baseline", "candidate_model_id", "baseline_model_id", "data", "baseline_generations")
ABSENT = {"recipe": None, "endpoint": None, "speculative": None, "kv_cache_dtype": defaults.KV_CACHE_DTYPE,
          "diagnose_batches": defaults.DIAGNOSE_BATCHES, "rejudge": False, "candidate_endpoint": None,
          "baseline_endpoint": None, "baseline": None, "candidate_model_id": None, "baseline_model_id": None}


@dataclass(frozen=True, kw_only=True)
class CommonSignoffConfig:
    """What every mode reads: the model, the folder, the policy, the quality looks and the bench's load."""

    output: str
    model: str = defaults.MODEL
    policy: str = defaults.POLICY
    limit: int = defaults.LIMIT
    concurrency: list[int] = field(default_factory=lambda: list(defaults.CONCURRENCY))
    num_requests: int | None = None
    mean_output_tokens: int = defaults.MEAN_OUTPUT_TOKENS
    seed: int = 0
    rounds: int = defaults.ROUNDS  # of every ablation system (a deployment: both endpoints) at every tier
    max_rounds: int | None = defaults.MAX_ROUNDS  # the speed gates' budget: more rounds while a gate is undecided
    # budget of items per task when a quality gate is inconclusive (qtoolkit/signoff/sequential.py); None: one look
    max_items: int | None = defaults.MAX_ITEMS
    allow_weak_sandbox: bool = False  # run model-written code even where bubblewrap cannot
    data: list[str] = field(default_factory=list)  # workload files: custom:STEM tasks and the bench's traffic
    # the baseline's completions on disk (evals/backends/cached.py): a sweep generates them once for its candidates
    baseline_generations: str | None = None

    def to_json(self) -> dict[str, Any]:
        """report.json's `config`: the flat record (FLAT_FIELDS), fields of other modes as ABSENT says."""
        mine = asdict(self)
        return {k: mine[k] if k in mine else ABSENT[k] for k in FLAT_FIELDS}


@dataclass(frozen=True, kw_only=True)
class EngineSignoffConfig(CommonSignoffConfig):
    """What a sign-off reads when qtoolkit quantizes the candidate and serves it on its own engine."""

    endpoint: str | None = None  # evaluate the candidate through a served endpoint instead of the engine
    speculative: str | None = defaults.SPECULATIVE  # e.g. "ngram": adds the speculative layer to the ablation
    # the candidate's KV cache in its eval and bench servers; auto: the checkpoint's kv_cache_scheme when it has
    # one, else the model's dtype. A quantized cache adds the ablation's KV cache layer (bench_kv.json)
    kv_cache_dtype: str = defaults.KV_CACHE_DTYPE
    diagnose_batches: tuple[int, ...] = defaults.DIAGNOSE_BATCHES


@dataclass(frozen=True, kw_only=True)
class LocalSignoffConfig(EngineSignoffConfig):
    """`qtool signoff --recipe R`: quantize with one recipe here, evaluate, benchmark, diagnose, decide."""

    recipe: str  # a shipped recipe's name or a YAML path
    rejudge: bool = False  # decide again from the step outputs in `output`, running nothing


@dataclass(frozen=True, kw_only=True)
class SweepSignoffConfig(EngineSignoffConfig):
    """`qtool signoff --recipe a,b,c`: a local sign-off per recipe against one baseline, one recommendation."""

    recipes: tuple[str, ...]

    def candidate(self, recipe: str, output: str, baseline_generations: str) -> LocalSignoffConfig:
        """One recipe's own sign-off, in its folder, reading the baseline's completions the sweep shares."""
        common = {f.name: getattr(self, f.name) for f in fields(EngineSignoffConfig)}
        return LocalSignoffConfig(**common | {"recipe": recipe, "output": output,
                                              "baseline_generations": baseline_generations})

    def to_json(self) -> dict[str, Any]:
        return super().to_json() | {"recipe": ",".join(self.recipes)}  # the flat record held --recipe as given


@dataclass(frozen=True, kw_only=True)
class EndpointsSignoffConfig(CommonSignoffConfig):
    """What a sign-off reads when both sides are served by OpenAI-compatible endpoints; `model` and `baseline`
    name the local checkpoints (tokenizers, memory figures)."""

    baseline_endpoint: str
    baseline: str | None = None  # the baseline endpoint's local checkpoint (default: `model`)
    candidate_model_id: str | None = None  # the model id the candidate endpoint must serve (default: its only one)
    baseline_model_id: str | None = None
    rounds: int = defaults.DEPLOYMENT_ROUNDS  # a deployment has no ablation to spend rounds on


@dataclass(frozen=True, kw_only=True)
class DeploymentSignoffConfig(EndpointsSignoffConfig):
    """`qtool signoff --candidate-endpoint URL --baseline-endpoint URL`: sign off the deployment that ships."""

    candidate_endpoint: str


@dataclass(frozen=True, kw_only=True)
class EndpointSweepSignoffConfig(EndpointsSignoffConfig):
    """`qtool signoff --candidate-endpoint a=URL --candidate-endpoint b=URL ...`: a deployment sign-off per served
    candidate against one baseline endpoint, one recommendation (`model` is then only their tokenizer)."""

    candidates: tuple[tuple[str, str], ...]  # (name, url)

    def candidate(self, url: str, output: str, baseline_generations: str) -> DeploymentSignoffConfig:
        """One served candidate's own deployment sign-off, in its folder."""
        common = {f.name: getattr(self, f.name) for f in fields(EndpointsSignoffConfig)}
        return DeploymentSignoffConfig(**common | {"candidate_endpoint": url, "output": output,
                                                   "baseline_generations": baseline_generations})

    def to_json(self) -> dict[str, Any]:
        # the flat record held the first candidate's URL
        return super().to_json() | {"candidate_endpoint": self.candidates[0][1]}


# a sign-off's configuration: its type is its mode
SignoffConfig = LocalSignoffConfig | DeploymentSignoffConfig | SweepSignoffConfig | EndpointSweepSignoffConfig

