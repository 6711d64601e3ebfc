"""One request's state inside the engine: tokens, KV blocks, progress, detokenized text and finish reason."""

from __future__ import annotations

import enum
import itertools

import torch

from .params import RequestOutput, SamplingParams

_arrival = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids (prompt then output) and how many of them already have KV in the paged cache."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tokenizer=None):
        self.request_id = request_id
        self.arrival = next(_arrival)  # FCFS order, also decides who is preempted first (latest arrival)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # hash chain of the leading full blocks registered for prefix reuse
        self.finish_reason: str | None = None
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator()
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids) if tokenizer is not None else None
        self._reported_tokens = 0
        self._reported_chars = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def text(self) -> str:
        return self.detok.text if self.detok is not None else ""

    def append_token(self, token_id: int) -> str:
        """Add a sampled token; returns the newly decoded text."""
        self.token_ids.append(token_id)
        return self.detok.step(self.output_token_ids) if self.detok is not None else ""

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        if self.detok is not None and reason != "stop":
            self.detok.flush(self.output_token_ids)

    def report(self) -> RequestOutput:
        """The delta since the previous report plus the cumulative output so far."""
        out_ids = self.output_token_ids
        text = self.text
        new_ids = out_ids[self._reported_tokens:]
        new_text = text[self._reported_chars:]
        self._reported_tokens = len(out_ids)
        self._reported_chars = len(text)
        return RequestOutput(
            request_id=self.request_id, new_token_ids=new_ids, new_text=new_text, finished=self.finished,
            finish_reason=self.finish_reason, num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=len(out_ids), text=text, token_ids=list(out_ids),
        )


class IncrementalDetokenizer:
    """Decode output tokens a few at a time without re-decoding the whole output every step.

    Decoding a window that starts a few tokens back keeps tokenizers that merge or strip leading spaces
    (SentencePiece) honest; text ending in U+FFFD is an incomplete UTF-8 sequence and waits for more tokens.
    """

    CONTEXT = 5

    def __init__(self, tokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.context = list(prompt_token_ids[-self.CONTEXT:])
        self.prefix_offset = 0  # window start, in context+output coordinates
        self.read_offset = len(self.context)  # tokens before this are already in self.text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def step(self, output_ids: list[int], final: bool = False) -> str:
        ids = self.context + output_ids
        prefix_text = self._decode(ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith("\ufffd")):
            new = full_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            self.text += new
            return new
        return ""

    def flush(self, output_ids: list[int]) -> None:
        self.step(output_ids, final=True)

    def truncate(self, length: int) -> None:
        self.text = self.text[:length]
