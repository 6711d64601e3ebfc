"""The engine API: requests in, one scheduler iteration per step(), RequestOutputs out.

add_request / abort_request may be called from other threads (an HTTP server's event loop): they only queue
the change, and step() applies queued changes before it schedules.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import threading
import time
from collections import deque
from typing import Any

import torch
from transformers import AutoTokenizer

from ..errors import QToolError
from ..model.loader import load_model
from ..model.sources import ModelSource, resolve_model
from ..progress import bar, quiet
from .block_manager import BlockManager
from .config import BATCHING_MODES, EngineConfig
from .model_runner import Chunk, ModelRunner, kv_bytes_per_block
from .params import EngineInputError, RequestOutput, SamplingParams
from .sampler import sample
from .scheduler import Scheduler, WorkItem
from .scoring import TokenLogprobs
from .sequence import Sequence
from .speculative import (
    Proposer,
    SpeculationPolicy,
    Speculator,
)
from .stats import EngineMode, EngineStats, SpeculativeStats

log = logging.getLogger(__name__)


class EngineCapacityError(QToolError):
    """The KV cache is too small for what was asked."""


class EngineBusyError(QToolError):
    """The engine has requests in flight, so its mode cannot change now."""


class Engine:
    def __init__(self, model: str | ModelSource = "default", config: EngineConfig | None = None,
                 **options: Any):
        """`config` holds every engine option (EngineConfig's defaults when None); `options` replace single
        fields of it, e.g. Engine(model, kv_cache_memory="256MiB"). Bad options fail before the model loads."""
        self.config = config = (config or EngineConfig()).replace(**options)
        spec, dtype, block_size = config.speculative_spec, config.dtype, config.block_size
        max_num_seqs, num_speculative_tokens = config.max_num_seqs, config.num_speculative_tokens
        max_verify_tokens = config.max_verify_tokens
        self.source = model if isinstance(model, ModelSource) else resolve_model(model)
        self.model_name = self.source.name
        self.tokenizer = AutoTokenizer.from_pretrained(self.source.path)
        self.model = load_model(self.source, dtype)
        block_bytes = kv_bytes_per_block(self.model, block_size, config.kv_cache_dtype)
        num_blocks = config.kv_blocks(block_bytes)
        if num_blocks < 2:
            raise EngineCapacityError(f"a KV cache of {config.kv_budget} holds {num_blocks} KV blocks: give it at "
                                      f"least {2 * block_bytes} bytes ({2 * block_size} tokens)")
        self.kv_bytes_per_token = block_bytes // block_size
        log.info("KV cache: %s, %d blocks of %d tokens = %d tokens in %s (%d bytes a token)", config.kv_cache_dtype,
                 num_blocks, block_size, num_blocks * block_size, config.kv_budget, self.kv_bytes_per_token)
        self.max_model_len = min(self.model.config.max_position_embeddings, num_blocks * block_size,
                                 config.max_model_len or 1 << 62)
        self.block_manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens, batching=config.batching)
        self.runner = ModelRunner(self.model, num_blocks, block_size, config.kv_cache_dtype)
        # when every layer slides a window, blocks wholly behind the smallest one are freed as sequences advance
        windows = [self.model.config.layer_window(i) for i in range(self.model.config.num_layers)]
        self.kv_window = None if None in windows else min(windows)
        self.speculator = None if spec is None else Speculator.build(
            spec, self.model, self.tokenizer, self.runner, self.block_manager, dtype=dtype,
            num_speculative_tokens=num_speculative_tokens, max_verify_tokens=max_verify_tokens,
            max_num_seqs=max_num_seqs)
        if self.speculator is not None:
            self.max_model_len = min(self.max_model_len, self.speculator.max_model_len)
        self._loaded_speculator = self.speculator  # kept while speculation is switched off (set_mode)
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
                    seq.finish("abort")
                    aborted.append(self._report(seq))
                    self._remove(seq)
        return aborted

    # -- one iteration ------------------------------------------------------------------------------------
    @property
    def proposer(self) -> Proposer | None:
        return self.speculator.proposer if self.speculator is not None else None

    @property
    def spec_policy(self) -> SpeculationPolicy | None:
        return self.speculator.policy if self.speculator is not None else None

    def _remove(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        if self.speculator is not None:
            self.speculator.release(seq)

    def _report(self, seq: Sequence) -> RequestOutput:
        out = seq.report()
        if self.speculator is None:
            return out
        return dataclasses.replace(out, speculative=self.speculator.usage_of(seq.request_id))

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> (propose drafts) -> run -> sample (or verify drafts) -> commit."""
        with self._lock:
            outputs = self._apply_inbox()
            work = self.scheduler.schedule().work
            if not work:
                return outputs
            if self.speculator is not None:
                self.speculator.propose(work, self.max_model_len, self.scheduler.max_num_batched_tokens)
            started = time.perf_counter()
            ran = self.runner.step(work, self.speculator.aux_layers if self.speculator is not None else ())
            new_tokens = self._choose_tokens(work, ran.logits)
            if self.speculator is not None:
                self.speculator.observe(work, new_tokens, ran.aux, time.perf_counter() - started)
            for item, tokens in zip(work, new_tokens, strict=True):
                if (out := self._commit(item, tokens)) is not None:
                    outputs.append(out)
            self.counters["steps"] += 1
            return outputs

    def _choose_tokens(self, work: list[WorkItem], logits: torch.Tensor) -> list[list[int]]:
        """The tokens each item gains this step: none (a prefill chunk), one sampled token, or the verified run
        of its drafts."""
        rows, plain, offset = [], [], 0
        for i, item in enumerate(work):
            rows.append(offset)
            if item.num_logits and not item.drafts:
                plain.append(i)
            offset += item.num_logits
        chosen: list[list[int]] = [[] for _ in work]
        if plain:
            plain_logits = logits if len(plain) == offset else \
                logits.index_select(0, torch.tensor([rows[i] for i in plain]))
            seqs = [work[i].seq for i in plain]
            for i, token in zip(plain, sample(plain_logits, [s.params for s in seqs], [s.generator for s in seqs]),
                                strict=True):
                chosen[i] = [token]
        for i, item in enumerate(work):
            if item.drafts:
                chosen[i] = self.speculator.verify(item, logits[rows[i]:rows[i] + item.num_logits])
        return chosen

    def _commit(self, item: WorkItem, tokens: list[int]) -> RequestOutput | None:
        """Advance the sequence past what this step computed, append its new tokens (up to a finish) and hand
        back its report when it gained any."""
        seq = item.seq
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            self.counters["prompt_tokens"] += min(item.num_new, seq.num_prompt_tokens - seq.num_computed_tokens)
        seq.num_computed_tokens += item.kept(tokens)
        if self.speculator is not None:
            self.speculator.settle(item)
        for token in tokens:
            new_text = seq.append_token(token)
            self.counters["generation_tokens"] += 1
            self._check_finished(seq, token, new_text)
            if seq.finished:  # EOS, a stop string or max_tokens inside an accepted run: drop the rest
                out = self._report(seq)
                self._remove(seq)
                self._seqs.pop(seq.request_id, None)
                self.counters["requests_finished"] += 1
                return out
        self.block_manager.register_full_blocks(seq)
        if self.kv_window is not None:  # the next query, at num_computed_tokens, sees kv_window positions
            self.block_manager.free_before(seq, seq.num_computed_tokens - self.kv_window + 1)
        return self._report(seq) if tokens else None

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

    # -- mode -------------------------------------------------------------------------------------------------
    @property
    def mode(self) -> EngineMode:
        return EngineMode(self.scheduler.batching, self.speculator is not None,
                          self.config.speculative if self._loaded_speculator is not None else None)

    def set_mode(self, *, batching: str | None = None, speculative: bool | None = None) -> EngineMode:
        """Switch batching (continuous/static) and whether the loaded proposer is used, on an idle engine only.

        One loaded engine then measures several systems in turn (the bench's layers) instead of one process
        per system. The prefix cache is emptied, so the next measurement finds the cache a fresh server would."""
        if batching is not None and batching not in BATCHING_MODES:
            raise EngineInputError(f"batching {batching!r} is unknown: use continuous or static")
        if speculative and self._loaded_speculator is None:
            raise EngineInputError("this engine has no proposer to switch on: start it with --speculative")
        with self._lock:
            if self.has_unfinished_requests():
                raise EngineBusyError("the engine is running requests: switch its mode when none are in flight")
            if batching is not None:
                self.scheduler.batching = batching
            if speculative is not None:
                self.speculator = self._loaded_speculator if speculative else None
            self.block_manager.reset_prefix_cache()
            return self.mode

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
    def score(self, token_ids: list[list[int]], top_k: int | None = None) -> list[torch.Tensor] | list[TokenLogprobs]:
        """Teacher-forced log-softmax [T, vocab] float32 per sequence: row i is log p(. | tokens[:i+1]); with
        `top_k`, only each row's next-token figure and k best alternatives (TokenLogprobs).

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
                    chunks = [Chunk(s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n], s.num_computed_tokens,
                                    s.block_table, n) for s, n in work]
                    logprobs = self.runner.forward(chunks).log_softmax(dim=-1)
                    offset = 0
                    for seq, n in work:
                        rows = logprobs[offset:offset + n]
                        pieces[index[id(seq)]].append(rows if top_k is None else
                                                      TokenLogprobs.of(rows, seq.token_ids, seq.num_computed_tokens,
                                                                       top_k))
                        offset += n
                        seq.num_computed_tokens += n
                    while first < len(seqs) and seqs[first].num_uncomputed_tokens == 0:
                        bm.release(seqs[first])
                        first += 1
            finally:
                for seq in seqs:
                    if seq.block_table:
                        bm.release(seq)
        if top_k is not None:
            return [TokenLogprobs.cat(p) for p in pieces]
        return [torch.cat(p) if len(p) > 1 else p[0] for p in pieces]

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + sum(1 for k, _ in self._inbox if k == "add"),
            kv_blocks_total=bm.num_blocks, kv_blocks_used=bm.num_blocks - bm.num_free_blocks,
            kv_blocks_free=bm.num_free_blocks, block_size=bm.block_size,
            kv_cache_dtype=self.config.kv_cache_dtype, kv_bytes_per_token=self.kv_bytes_per_token,
            num_preemptions=self.scheduler.num_preemptions, prefix_cache_hit_tokens=bm.num_prefix_hits,
            **self.counters, speculative=self._speculative_stats(), batching=self.scheduler.batching)

    def _speculative_stats(self) -> SpeculativeStats | None:
        if self.speculator is None:
            return None
        m, policy = self.speculator.metrics, self.speculator.policy
        return SpeculativeStats.snapshot(m, draft_cost_ratio=policy.draft_cost,
                                         verify_cost_per_token=policy.verify_cost)
