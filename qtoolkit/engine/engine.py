"""The engine API: requests in, one scheduler iteration per step(), RequestOutputs out.

add_request / abort_request may be called from other threads (an HTTP server's event loop): they only queue
the change, and step() applies queued changes before it schedules.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import deque
from typing import Any

import torch
from transformers import AutoTokenizer

from ..errors import QToolError
from ..model.loader import load_model
from ..progress import bar, quiet
from ..sources import ModelSource, resolve_model
from .block_manager import BlockManager
from .config import EngineConfig
from .model_runner import ModelRunner, kv_bytes_per_block
from .params import EngineInputError, RequestOutput, SamplingParams
from .sampler import sample
from .scheduler import Scheduler
from .sequence import Sequence
from .speculative import (
    MAX_SPECULATIVE_TOKENS,
    Proposal,
    Proposer,
    SpeculationPolicy,
    SpeculativeMetrics,
    build_proposer,
    verify,
)
from .stats import EngineStats, SpeculativeStats

# a model draft catches up on a long context (over CATCH_UP_MIN_TOKENS) only when the request may still generate
# at least 1/CATCH_UP_RATIO as many tokens
CATCH_UP_RATIO = 2
CATCH_UP_MIN_TOKENS = 128


class EngineCapacityError(QToolError):
    """The KV cache is too small for what was asked."""


class Engine:
    def __init__(self, model: str | ModelSource = "default", config: EngineConfig | None = None,
                 **options: Any):
        """`config` holds every engine option (EngineConfig's defaults when None); `options` replace single
        fields of it, e.g. Engine(model, kv_cache_memory="256MiB"). Bad options fail before the model loads."""
        self.config = config = (config or EngineConfig()).replace(**options)
        spec, dtype, block_size = config.speculative, config.dtype, config.block_size
        max_num_seqs, num_speculative_tokens = config.max_num_seqs, config.num_speculative_tokens
        max_verify_tokens = config.max_verify_tokens
        self.source = model if isinstance(model, ModelSource) else resolve_model(model)
        self.model_name = self.source.name
        self.tokenizer = AutoTokenizer.from_pretrained(self.source.path)
        self.model = load_model(self.source, dtype)
        num_blocks = config.kv_cache_bytes // kv_bytes_per_block(self.model, block_size)
        if num_blocks < 2:
            raise EngineCapacityError(f"kv_cache_memory {config.kv_cache_memory} holds {num_blocks} KV blocks: "
                                      f"give it at least {2 * kv_bytes_per_block(self.model, block_size)} bytes")
        self.max_model_len = min(self.model.config.max_position_embeddings, num_blocks * block_size,
                                 config.max_model_len or 1 << 62)
        self.block_manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens, batching=config.batching)
        self.runner = ModelRunner(self.model, num_blocks, block_size)
        # when every layer slides a window, blocks wholly behind the smallest one are freed as sequences advance
        windows = [self.model.config.layer_window(i) for i in range(self.model.config.num_layers)]
        self.kv_window = None if None in windows else min(windows)
        self.proposer: Proposer | None = None
        self.spec_policy: SpeculationPolicy | None = None
        self.spec_metrics: SpeculativeMetrics | None = None
        self._last_propose_seconds = 0.0
        if spec is not None:
            # the draft's KV holds what the target's does plus k lookahead slots per running sequence
            extra = max_num_seqs * -(-MAX_SPECULATIVE_TOKENS // block_size)
            self.proposer = build_proposer(spec, self.model, self.tokenizer, num_blocks=num_blocks + extra,
                                           block_size=block_size, dtype=dtype, target_runner=self.runner)
            draft = getattr(self.proposer, "model", None)
            if draft is not None:
                self.max_model_len = min(self.max_model_len, draft.config.max_position_embeddings)
            self.spec_policy = SpeculationPolicy(num_speculative_tokens, max_verify_tokens)
            self.spec_metrics = SpeculativeMetrics(spec, num_speculative_tokens, max_verify_tokens)
        self.eos_token_ids = self._eos_ids()
        self._seqs: dict[str, Sequence] = {}
        self._inbox: deque[tuple[str, object]] = deque()
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "requests_finished": 0}

    def _eos_ids(self) -> set[int]:
        ids = set(self.model.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        gen = self.source.path / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else eos or [])
        return ids

    # -- requests ---------------------------------------------------------------------------------------
    def _make_sequence(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        params.validate()
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt).input_ids
        else:
            ids = [int(t) for t in prompt]
            vocab = self.model.config.vocab_size
            if any(t < 0 or t >= vocab for t in ids):
                raise EngineInputError(f"prompt token ids must lie in [0, {vocab}): check the tokenizer")
        if not ids:
            raise EngineInputError("the prompt is empty: give at least one token")
        if len(ids) >= self.max_model_len:
            raise EngineInputError(f"prompt has {len(ids)} tokens but the context holds {self.max_model_len} "
                                   "(prompt + output): shorten the prompt or raise --kv-cache-memory")
        return Sequence(request_id, ids, params, self.tokenizer)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        seq = self._make_sequence(request_id, prompt, params)
        with self._lock:
            if request_id in self._seqs or any(k == "add" and s.request_id == request_id for k, s in self._inbox):
                raise EngineInputError(f"request id {request_id!r} is already running: use a unique id")
            self._inbox.append(("add", seq))

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_unfinished()

    def _apply_inbox(self) -> list[RequestOutput]:
        aborted = []
        with self._lock:
            while self._inbox:
                kind, item = self._inbox.popleft()
                if kind == "add":
                    self._seqs[item.request_id] = item
                    self.scheduler.add(item)
                elif (seq := self._seqs.pop(item, None)) is not None:
                    self._remove(seq)
                    seq.finish("abort")
                    aborted.append(seq.report())
        return aborted

    # -- one iteration ------------------------------------------------------------------------------------
    def _remove(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        if self.proposer is not None:
            self.proposer.release(seq)

    def step(self) -> list[RequestOutput]:
        with self._lock:
            outputs = self._apply_inbox()
            plan = self.scheduler.schedule()
            if not plan:
                return outputs
            work = plan.work
            num_logits = [1 if seq.num_computed_tokens + n == len(seq) else 0 for seq, n in work]
            proposals = self._propose(work, num_logits) if self.proposer is not None else {}
            t_verify = time.perf_counter()
            logits = self.runner.run(work, num_logits)
            new_tokens = self._choose_tokens(work, num_logits, logits, proposals)
            if self.spec_policy is not None:
                elapsed = time.perf_counter() - t_verify
                if proposals:
                    self.spec_metrics.verify_seconds += elapsed
                    drafts = [len(p.tokens) for p in proposals.values()]
                    self.spec_policy.observe_cost(self._last_propose_seconds, max(drafts), elapsed, len(work),
                                                  sum(drafts))
                elif all(n == 1 for _, n in work) and all(num_logits):
                    self.spec_policy.observe_plain(len(work), elapsed)
            for i, (seq, n) in enumerate(work):
                if seq.num_computed_tokens < seq.num_prompt_tokens:
                    self.counters["prompt_tokens"] += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
                if i in proposals:
                    # only the accepted drafts keep their KV; the rejected slots are handed back
                    seq.num_computed_tokens += len(new_tokens[i])
                    self.block_manager.shrink(seq, seq.num_computed_tokens)
                else:
                    seq.num_computed_tokens += n
                self.block_manager.register_full_blocks(seq)
                if self.kv_window is not None:  # the next query, at num_computed_tokens, sees kv_window positions
                    self.block_manager.free_before(seq, seq.num_computed_tokens - self.kv_window + 1)
            self.counters["steps"] += 1
            for i, (seq, _) in enumerate(work):
                for token in new_tokens.get(i, ()):
                    new_text = seq.append_token(token)
                    self.counters["generation_tokens"] += 1
                    self._check_finished(seq, token, new_text)
                    if seq.finished:  # EOS, a stop string or max_tokens inside an accepted run: drop the rest
                        self._remove(seq)
                        self._seqs.pop(seq.request_id, None)
                        self.counters["requests_finished"] += 1
                        break
                if i in new_tokens:
                    outputs.append(seq.report())
            return outputs

    def _propose(self, work: list[tuple[Sequence, int]], num_logits: list[int]) -> dict[int, Proposal]:
        """Ask the proposer for the decoding sequences' drafts; they are appended to the sequences' tokens
        (and KV blocks) so the verification forward scores them, and taken back out after verification."""
        decoding = [i for i, (seq, n) in enumerate(work) if n == 1 and num_logits[i] == 1]
        if not decoding:
            return {}
        step_tokens = sum(n for _, n in work)
        caps = []
        for i in decoding:
            seq = work[i][0]
            left = seq.params.max_tokens - seq.num_output_tokens - 1
            # never draft past max_tokens (the target adds one token of its own) or the context
            cap = max(0, min(left, self.max_model_len - len(seq), self.scheduler.max_num_batched_tokens - step_tokens))
            # a draft model must first run the context it has not seen (the prompt, at the first proposal): not
            # worth it when that is longer than what drafting could save over the rest of the request (a 250-token
            # summarization prompt before a 50-token answer cost the self-int4 server 10-30% without this)
            behind = self.proposer.catch_up_tokens(seq) if cap else 0
            if behind > CATCH_UP_MIN_TOKENS and behind > CATCH_UP_RATIO * left:
                cap = 0
            caps.append(cap)
        ks = self.spec_policy.plan([(work[i][0], c) for i, c in zip(decoding, caps, strict=True)], step_tokens)
        batch = []
        for i, k in zip(decoding, ks, strict=True):
            seq = work[i][0]
            while k > 0 and not self.block_manager.can_grow(seq, len(seq) + k):
                k -= 1  # speculation never preempts anyone: it only uses free blocks
            if k > 0:
                self.block_manager.grow(seq, len(seq) + k)  # reserved now, so the next sequence sees the rest
                batch.append((i, k))
        if not batch:
            self.spec_metrics.steps_without_speculation += 1
            return {}
        t0 = time.perf_counter()
        drafted = self.proposer.propose([(work[i][0], k) for i, k in batch])
        self._last_propose_seconds = time.perf_counter() - t0
        self.spec_metrics.proposer_seconds += self._last_propose_seconds
        proposals = {}
        for (i, k), proposal in zip(batch, drafted, strict=True):
            seq = work[i][0]
            proposal.tokens = proposal.tokens[:k]
            seq.token_ids.extend(proposal.tokens)
            self.block_manager.shrink(seq, len(seq))  # hand back the reserve a shorter proposal did not use
            if not proposal.tokens:
                continue
            work[i] = (seq, 1 + len(proposal.tokens))
            num_logits[i] = 1 + len(proposal.tokens)
            proposals[i] = proposal
        if proposals:
            self.spec_metrics.steps_with_speculation += 1
        else:
            self.spec_metrics.steps_without_speculation += 1
        return proposals

    def _choose_tokens(self, work: list[tuple[Sequence, int]], num_logits: list[int], logits: torch.Tensor,
                       proposals: dict[int, Proposal]) -> dict[int, list[int]]:
        """The tokens each sequence gains this step: one sampled token, or the verified run of a proposal."""
        rows, plain, offset = {}, [], 0
        for i, count in enumerate(num_logits):
            rows[i] = offset
            if count and i not in proposals:
                plain.append(i)
            offset += count
        chosen: dict[int, list[int]] = {}
        if plain:
            plain_logits = logits if not proposals else logits.index_select(0, torch.tensor([rows[i] for i in plain]))
            seqs = [work[i][0] for i in plain]
            sampled = sample(plain_logits, [s.params for s in seqs], [s.generator for s in seqs])
            chosen.update((i, [t]) for i, t in zip(plain, sampled, strict=True))
        for i, proposal in proposals.items():
            seq, k = work[i][0], len(proposal.tokens)
            del seq.token_ids[-k:]
            tokens = verify(logits[rows[i]:rows[i] + k + 1], proposal.tokens, proposal.draft_probs, seq.params,
                            seq.generator)
            accepted = len(tokens) - 1
            seq.num_draft_tokens += k
            seq.num_accepted_tokens += accepted
            seq.num_spec_steps += 1
            self.spec_policy.update(seq, k, accepted)
            self.spec_metrics.record(k, accepted)
            chosen[i] = tokens
        return dict(sorted(chosen.items()))

    def _check_finished(self, seq: Sequence, token: int, new_text: str) -> None:
        p = seq.params
        if p.stop and new_text:
            text = seq.text
            window = len(new_text) + max(map(len, p.stop)) - 1
            hits = [i for s in p.stop if (i := text.find(s, max(0, len(text) - window))) >= 0]
            if hits:
                seq.detok.truncate(min(hits))
                seq.finish("stop")
                return
        if token in self.eos_token_ids and not p.ignore_eos:
            seq.finish("stop")
        elif seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            seq.finish("length")

    # -- batch helpers --------------------------------------------------------------------------------------
    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts to completion; final outputs in input order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise EngineInputError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        batch = next(self._ids)
        ids = [f"generate-{batch}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list, strict=True):
            self.add_request(rid, prompt, p)
        final: dict[str, RequestOutput] = {}
        progress = bar(total=len(ids), desc="generate", unit="req", disable=not use_tqdm or quiet())
        try:
            while len(final) < len(ids):
                for out in self.step():
                    if out.finished and out.request_id in ids:
                        final[out.request_id] = out
                        progress.update(1)
        except BaseException:
            for rid in ids:
                if rid not in final:
                    self.abort_request(rid)
            self._apply_inbox()
            raise
        finally:
            progress.close()
        return [final[rid] for rid in ids]

    @torch.inference_mode()
    def score(self, token_ids: list[list[int]]) -> list[torch.Tensor]:
        """Teacher-forced log-softmax [T, vocab] float32 per sequence: row i is log p(. | tokens[:i+1]).

        Sequences are packed into steps of max_num_batched_tokens (long ones chunked) over borrowed KV
        blocks that are all released before returning."""
        bm, budget = self.block_manager, self.scheduler.max_num_batched_tokens
        seqs = []
        for i, ids in enumerate(token_ids):
            if not 0 < len(ids) <= self.max_model_len:
                raise EngineInputError(f"cannot score {len(ids)} tokens: give 1 to {self.max_model_len} tokens "
                                       "(the context length)")
            seqs.append(Sequence(f"score-{i}", [int(t) for t in ids], SamplingParams(max_tokens=1)))
        index = {id(seq): i for i, seq in enumerate(seqs)}
        pieces: list[list[torch.Tensor]] = [[] for _ in seqs]
        with self._lock:
            try:
                first = 0
                while first < len(seqs):
                    work, left = [], budget
                    for seq in seqs[first:]:
                        n = min(seq.num_uncomputed_tokens, left)
                        if not bm.can_grow(seq, seq.num_computed_tokens + n):
                            break
                        bm.grow(seq, seq.num_computed_tokens + n)
                        work.append((seq, n))
                        left -= n
                        if left == 0:
                            break
                    if not work:
                        raise EngineCapacityError(f"not enough free KV blocks to score {len(seqs[first])} tokens: "
                                                  "raise kv_cache_memory or score while no requests run")
                    logprobs = self.runner.run(work, [n for _, n in work]).log_softmax(dim=-1)
                    offset = 0
                    for seq, n in work:
                        pieces[index[id(seq)]].append(logprobs[offset:offset + n])
                        offset += n
                        seq.num_computed_tokens += n
                    while first < len(seqs) and seqs[first].num_uncomputed_tokens == 0:
                        bm.release(seqs[first])
                        first += 1
            finally:
                for seq in seqs:
                    if seq.block_table:
                        bm.release(seq)
        return [torch.cat(p) if len(p) > 1 else p[0] for p in pieces]

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + sum(1 for k, _ in self._inbox if k == "add"),
            kv_blocks_total=bm.num_blocks, kv_blocks_used=bm.num_blocks - bm.num_free_blocks,
            kv_blocks_free=bm.num_free_blocks, block_size=bm.block_size,
            num_preemptions=self.scheduler.num_preemptions, prefix_cache_hit_tokens=bm.num_prefix_hits,
            **self.counters, speculative=self._speculative_stats())

    def _speculative_stats(self) -> SpeculativeStats | None:
        m = self.spec_metrics
        if m is None:
            return None
        return SpeculativeStats(
            proposer=m.proposer, num_speculative_tokens=m.num_speculative_tokens,
            max_verify_tokens=m.max_verify_tokens, verify_steps=m.verify_steps, draft_tokens=m.draft_tokens,
            accepted_tokens=m.accepted_tokens, proposed_at=list(m.proposed_at), accepted_at=list(m.accepted_at),
            steps_with_speculation=m.steps_with_speculation, steps_without_speculation=m.steps_without_speculation,
            proposer_seconds=m.proposer_seconds, verify_seconds=m.verify_seconds,
            draft_cost_ratio=self.spec_policy.draft_cost, verify_cost_per_token=self.spec_policy.verify_cost)
