"""Issue #15's bar on the current tree (EngineConfig, ModelRunner, engine/speculative/), as a user would try it.

Per family (tiny random llama3-rope, qwen2, qwen3, gemma3_text, mistral window 16, qwen3_moe, mixtral; 4 layers,
the default model's tokenizer, weights x10 so greedy argmax has no near-ties):
- through the CLI (its entry point `qtoolkit.cli.main`, called in-process): `qtool generate --temperature 0` at batch 1 on a short (9-10 tokens) and a long (104 tokens,
  past every window) prompt against transformers' greedy `generate` in fp32; `qtool quantize --recipe int4-rtn`,
  then `qtool generate` on the INT4 checkpoint and `qtool eval --task perplexity` of it against the dense model;
- through the engine API (what the CLI cannot show: preemption and draft counts): a mixed batch of 8 prompts in a
  KV cache too small for all of them (preemptions counted), and ngram speculation (drafts counted), each token for
  token against transformers;
- the README's supported-families table lists every model_type.
Writes bar-issue15.json beside this file: every figure measured, nothing hard-coded.

Run from the repository root: QTOOLKIT_SRC=$PWD OMP_NUM_THREADS=1 python3 measurements/2026-12-01/session7/bar-issue15.py
(FAMILIES=qwen2,mixtral runs a subset and writes bar-issue15-SUBSET.json)
"""

import contextlib
import io
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from qtoolkit import cli
from qtoolkit.engine import Engine, SamplingParams
from qtoolkit.model.sources import resolve_model

ROOT = Path(__file__).resolve().parents[3]
SHORT = "def add(a, b):\n    return"
LONG = ("Summarize: the committee met on Tuesday to review the budget. After a long debate about the roads, the "
        "schools and the new library, the members agreed to postpone the vote until the auditors had finished "
        "their report, which is expected next month. ") * 2
REPEAT = "one two three four five six seven eight nine ten " * 4  # prompt lookup finds its n-grams
NEW = 20


def configs(tok) -> dict:
    c = dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=2048, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
             pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    return {
        "llama3-rope": LlamaConfig(**c, intermediate_size=128, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "qwen2": Qwen2Config(**c, intermediate_size=128),
        "qwen3": Qwen3Config(**c, intermediate_size=128, head_dim=32),
        "gemma3_text": Gemma3TextConfig(**{**c, "tie_word_embeddings": True}, intermediate_size=128, head_dim=16,
                                        sliding_window=12, layer_types=["sliding_attention", "sliding_attention",
                                                                        "full_attention", "sliding_attention"]),
        "mistral-window16": MistralConfig(**c, intermediate_size=128, sliding_window=16),
        "qwen3_moe": Qwen3MoeConfig(**c, intermediate_size=128, moe_intermediate_size=32, head_dim=32, num_experts=4,
                                    num_experts_per_tok=2),
        "mixtral": MixtralConfig(**c, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                 sliding_window=None),
    }


def qtool(*args: str) -> subprocess.CompletedProcess:
    """`qtool ARGS` through the CLI's own entry point, in this process: on the loaded shared machine a process
    start (torch, transformers) costs a minute, which 35 calls cannot afford; the argument parsing, the command
    and its stdout are the ones `qtool` runs."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(list(args))
        except SystemExit as e:
            rc = e.code
    return subprocess.CompletedProcess(["qtool", *args], rc, out.getvalue(), err.getvalue())


def build(cfg, folder: Path, tok) -> AutoModelForCausalLM:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(10.0)  # sharp logits: no near-ties in greedy argmax
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model


def hf_greedy(model, ids: list[int], n: int, stop_at_eos: bool) -> list[int]:
    kw = {} if stop_at_eos else {"min_new_tokens": n}
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(ids):].tolist()


def cli_rows(folder: Path, model, tok, row: dict) -> None:
    """The bar itself: `qtool generate --temperature 0` at batch 1 equals transformers' greedy text."""
    for label, prompt in (("short", SHORT), ("long", LONG)):
        ids = tok(prompt).input_ids
        want = tok.decode(hf_greedy(model, ids, NEW, stop_at_eos=True), skip_special_tokens=True)
        r = qtool("generate", "--model", str(folder), "--prompt", prompt, "--temperature", "0",
                  "--max-tokens", str(NEW), "--kv-cache-memory", "16MiB")
        row[f"cli_{label}_prompt_tokens"] = len(ids)
        row[f"cli_{label}_rc"] = r.returncode
        row[f"cli_{label}_equal"] = r.returncode == 0 and r.stdout == want + "\n"
        if not row[f"cli_{label}_equal"]:
            row[f"cli_{label}_detail"] = [r.stdout[-200:], want[-200:], r.stderr[-300:]]
    t0 = time.monotonic()
    q = qtool("quantize", "--model", str(folder), "--recipe", "int4-rtn", "--output", str(folder) + "-int4")
    row["int4_rtn_quantize_rc"], row["int4_rtn_quantize_s"] = q.returncode, round(time.monotonic() - t0, 1)
    if q.returncode != 0:
        row["int4_rtn_quantize_detail"] = q.stderr[-300:]
        return
    cfg = json.loads((Path(str(folder) + "-int4") / "config.json").read_text())["quantization_config"]
    row["int4_checkpoint_bits"] = sorted({g["weights"]["num_bits"] for g in cfg["config_groups"].values()})
    g = qtool("generate", "--model", str(folder) + "-int4", "--prompt", SHORT, "--prompt", LONG,
              "--temperature", "0", "--max-tokens", "12", "--kv-cache-memory", "16MiB")
    row["int4_generate_rc"] = g.returncode
    row["int4_generate_outputs"] = re.findall(r"^=== \[\d+\] \((\d+) tokens, (\w+)\)$", g.stdout, flags=re.M)
    # point 5 of the issue: `qtool eval` runs the family (the INT4 checkpoint against its dense model)
    ev = Path(str(folder) + "-eval.json")
    e = qtool("eval", "--model", str(folder) + "-int4", "--baseline", str(folder), "--task", "perplexity",
              "--limit", "2", "--output", str(ev))
    row["eval_perplexity_rc"] = e.returncode
    if e.returncode == 0:
        summary = json.loads(ev.read_text())["tasks"]["perplexity"]["summary"]
        row["eval_kld_mean"] = {k: round(v["kld"]["mean_pm"][0], 4) for k, v in summary.items()
                                if isinstance(v, dict) and isinstance(v.get("kld"), dict)}
    else:
        row["eval_perplexity_detail"] = e.stderr[-300:]


def engine_rows(folder: Path, model, tok, row: dict) -> None:
    """Mixed batch with preemption and ngram speculation, token for token against transformers."""
    g = torch.Generator().manual_seed(7)
    prompts = [tok(SHORT).input_ids, tok(LONG).input_ids,
               *[torch.randint(0, 2000, (n,), generator=g).tolist() for n in (3, 60, 17, 40, 25, 8)]]
    lengths = [20, 16, 20, 12, 20, 18, 14, 20]
    refs = [hf_greedy(model, p, 20, stop_at_eos=False) for p in prompts]
    cfg = json.loads((folder / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = 2 * cfg["num_hidden_layers"] * 4 * cfg["num_key_value_heads"] * head_dim * 4  # fp32, 4 tokens
    engine = Engine(str(folder), kv_cache_memory=40 * per_block, block_size=4, max_num_seqs=8,
                    max_num_batched_tokens=32)
    outs = engine.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths], use_tqdm=False)
    stats = engine.stats()
    row["mixed_batch_requests"] = len(prompts)
    row["mixed_batch_equal"] = sum(o.token_ids == r[:n] for o, r, n in zip(outs, refs, lengths, strict=True))
    row["mixed_batch_preemptions"] = stats.num_preemptions
    row["mixed_batch_kv_blocks"] = stats.kv_blocks_total
    row["mixed_batch_blocks_left_used"] = stats.kv_blocks_used
    spec_prompts = [tok(REPEAT).input_ids, tok(LONG).input_ids, tok(SHORT).input_ids]
    spec_refs = [hf_greedy(model, p, 20, stop_at_eos=False) for p in spec_prompts]
    engine = Engine(str(folder), kv_cache_memory="16MiB", block_size=4, speculative="ngram",
                    num_speculative_tokens=4, max_verify_tokens=64)
    engine.spec_policy.adaptive = False  # keep proposing: verification through every layer type is the point
    outs = engine.generate(spec_prompts, SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    spec = engine.stats().speculative
    row["ngram_equal"] = sum(o.token_ids == r for o, r in zip(outs, spec_refs, strict=True))
    row["ngram_requests"] = len(spec_prompts)
    row["ngram_draft_tokens"], row["ngram_accepted_tokens"] = spec.draft_tokens, spec.accepted_tokens


def readme_families() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Supported model families", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\|[^|]+\| `([a-z0-9_]+)` \|", section, flags=re.M)


def main() -> None:
    os.environ["QTOOLKIT_QUIET"] = "1"  # what `qtool -q` sets: no progress bars in the captured output
    tok = AutoTokenizer.from_pretrained(resolve_model("default").path)
    only = os.environ.get("FAMILIES")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in configs(tok).items():
            if only and name not in only.split(","):
                continue
            t0 = time.monotonic()
            folder = Path(tmp) / name
            model = build(cfg, folder, tok)
            # the folder's tokenizer: beside a qwen2 config it loads as Qwen2Tokenizer, as `qtool` reads it
            folder_tok = AutoTokenizer.from_pretrained(folder)
            row = {"model_type": cfg.model_type, "sliding_window": getattr(cfg, "sliding_window", None)
                   if getattr(cfg, "use_sliding_window", True) else None}
            cli_rows(folder, model, folder_tok, row)
            engine_rows(folder, model, folder_tok, row)
            row["seconds"] = round(time.monotonic() - t0, 1)
            rows[name] = row
            print(name, json.dumps(row), flush=True)
    listed = readme_families()
    result = {"command": "QTOOLKIT_SRC=$PWD OMP_NUM_THREADS=1 python3 measurements/2026-12-01/session7/bar-issue15.py",
              "git_head": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                         cwd=ROOT).stdout.strip(),
              "readme_supported_model_types": listed,
              "every_family_in_readme": all(r["model_type"] in listed for r in rows.values()),
              "families": rows}
    out = Path(__file__).with_name("bar-issue15.json" if not only else f"bar-issue15-{only.replace(',', '-')}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
