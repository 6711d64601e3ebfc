"""How many tokens each running sequence speculates this step.

Per sequence, k maximizes the expected speedup of one verification step (Leviathan et al., section 3.5):
E(k) / ((1 + k * v) * (1 + k * r)), where E(k) = (1 - a^(k+1)) / (1 - a) is the expected number of tokens a
step emits given the sequence's per-token acceptance a (a moving estimate); v is what each extra verified token
adds to a plain decode step's time and r the cost of one draft step relative to the verification forward. Both
are measured by the engine as it runs: r is about 0 for prompt lookup and large for a draft model not much
cheaper than the target; v starts at 0.125 (fp32 verification of 4 drafts costs 1.50x a 1-token step on an idle
2-core CPU) and rises when other load makes the CPU compute-bound (5 tokens cost 3.5x a 1-token step under a load
average of ~8 on 2 cores, where speculation stops paying). When no k reaches a speedup of `min_gain` the sequence decodes
plainly for a few steps and then probes again with k = 1 (which also refreshes a and r).

v is kept per number of sequences in the step: at batch 1 a draft token adds ~0.1 of a plain step on a 2-core CPU,
at batch 4 ~0.4, so a draft that pays for one stream is switched off at four. A batch size whose plain step has
not been timed gets one plain step first, and one decode-only step in PLAIN_REFRESH_STEPS stays plain to keep
that time fresh.

Per step, speculation only fills the part of the batch where extra tokens are (nearly) free: a verification
forward's cost grows with the total number of tokens in the step, so proposals are added only while the step
holds at most `max_verify_tokens` tokens. Past that the batch itself keeps the matmuls busy and speculating
would cost more target compute than the accepted tokens save.

Default 8, from the fp32 cost curve of a plain-torch decoder on an idle 2-core CPU: a step of 1 token
costs 55 ms, 5 tokens (4-token verification) 1.50x that, 8 tokens 1.55x, 32 tokens 3.05x. Up to ~8 tokens a
step is bound by streaming the weights, so drafts ride along nearly free; past it cost grows with tokens and a
draft token must be accepted with probability above ~0.7 (plus the draft model's own cost) to pay for itself.
With prompt-lookup acceptance of 0.3-0.5 on chat prompts (measurements/2026-11-30/bench-serve-speculative-*.json) that is a loss, so at 8 or more
running sequences speculation is off and the engine decodes exactly as without it. Under a load average of ~10 on
2 cores step times spread over 1-8 s with no ordering between 1 and 9 tokens, so the curve cannot be taken on a
shared machine: the setting stays tunable (`max_verify_tokens`) for a quiet box.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

DEFAULT_MAX_VERIFY_TOKENS = 8
DEFAULT_VERIFY_COST = 0.125
# every this many decode-only steps at a batch size, one runs without proposals to refresh its plain-step time
PLAIN_REFRESH_STEPS = 50


@dataclass
class RequestPolicy:
    """The policy's state for one request."""

    acceptance: float = 0.8  # moving estimate of the per-draft-token acceptance probability
    cooldown: int = 0  # steps left without proposals after acceptance collapsed
    failed_probes: int = 0  # probes in a row that found speculation not paying (doubles the cooldown)


class SpeculationPolicy:
    def __init__(self, num_speculative_tokens: int, max_verify_tokens: int = DEFAULT_MAX_VERIFY_TOKENS,
                 adaptive: bool = True, min_gain: float = 1.05, cooldown_steps: int = 16, smoothing: float = 0.2):
        self.max_k = num_speculative_tokens
        self.max_verify_tokens = max_verify_tokens
        self.adaptive = adaptive
        self.min_gain, self.cooldown_steps, self.smoothing = min_gain, cooldown_steps, smoothing
        self.draft_cost = 0.0  # r: one draft step / one verification forward (median of recent steps)
        self._draft_samples: deque[float] = deque(maxlen=9)
        # v: extra time per verified draft token, in plain decode steps, per number of sequences in the step. It
        # grows with the batch (a step of 1 x 5 tokens cost 1.4x a plain one here, 4 x 2 tokens about 1.4x a
        # plain step of 4, i.e. 0.4 per draft token), so one global estimate learnt at batch 1 kept a self-draft
        # on at 4 sequences, where it lost 10-20%.
        self._verify_prior = DEFAULT_VERIFY_COST
        self._verify_costs: dict[int, float] = {}
        self._last_batch = 1
        self._plain_step: dict[int, float] = {}  # sequences in a decode-only step -> seconds (moving average)
        self._decode_steps: dict[int, int] = {}  # decode-only steps planned, per number of sequences
        self.requests: dict[str, RequestPolicy] = {}

    def state(self, request_id: str) -> RequestPolicy:
        state = self.requests.get(request_id)
        if state is None:
            state = self.requests[request_id] = RequestPolicy()
        return state

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted."""
        self.requests.pop(request_id, None)

    @staticmethod
    def expected_tokens(acceptance: float, k: int) -> float:
        a = min(acceptance, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    @property
    def verify_cost(self) -> float:
        """v at the batch size verified last (the figure /metrics shows)."""
        return self.verify_cost_at(self._last_batch)

    @verify_cost.setter
    def verify_cost(self, value: float) -> None:
        """Fix v at every batch size (tests, and the ceiling model of a measured v)."""
        self._verify_prior = value
        self._verify_costs.clear()

    def verify_cost_at(self, num_seqs: int) -> float:
        """v measured at this batch size, else at the largest smaller one measured (it only grows with the
        batch), else the prior."""
        if num_seqs in self._verify_costs:
            return self._verify_costs[num_seqs]
        below = [n for n in self._verify_costs if n < num_seqs]
        return self._verify_costs[max(below)] if below else self._verify_prior

    def best_k(self, acceptance: float, num_seqs: int = 1) -> tuple[int, float]:
        v = self.verify_cost_at(num_seqs)
        gains = [(self.expected_tokens(acceptance, k) / ((1 + k * v) * (1 + k * self.draft_cost)), k)
                 for k in range(1, self.max_k + 1)]
        gain, k = max(gains)
        return k, gain

    def wanted_k(self, request_id: str, num_seqs: int = 1) -> int:
        if not self.adaptive:
            return self.max_k
        state = self.state(request_id)
        if state.cooldown > 0:
            state.cooldown -= 1
            return 1 if state.cooldown == 0 else 0  # the probe
        k, gain = self.best_k(state.acceptance, num_seqs)
        if gain < self.min_gain:
            # each failed probe doubles the wait (16, 32, ... 1024 steps): a probe of a model draft costs a
            # catch-up forward, and a sequence where drafting does not pay should not keep paying for probes
            state.cooldown = min(self.cooldown_steps << state.failed_probes, 1024)
            state.failed_probes += 1
            return 0
        state.failed_probes = 0
        return k

    def plan(self, candidates: list[tuple[str, int]], step_tokens: int) -> list[int]:
        """k for each (request id, most it may take) that could speculate, given the step's other tokens.

        The spare tokens under max_verify_tokens go one at a time, round robin, to the sequences with the best
        recent acceptance first, so a single stream gets its whole k and a growing batch shares a shrinking pool.
        """
        ks = [0] * len(candidates)
        spare = self.max_verify_tokens - step_tokens
        if spare <= 0 or not candidates:
            return ks
        n = len(candidates)
        if self.adaptive and step_tokens == n:  # a decode-only step: its plain time is what v is measured against
            seen = self._decode_steps.get(n, 0)
            self._decode_steps[n] = seen + 1
            if n not in self._plain_step or seen % PLAIN_REFRESH_STEPS == PLAIN_REFRESH_STEPS - 1:
                return ks
        wants = [min(self.wanted_k(rid, n), cap) for rid, cap in candidates]
        order = sorted(range(len(candidates)), key=lambda i: -self.state(candidates[i][0]).acceptance)
        while spare > 0:
            given = False
            for i in order:
                if spare > 0 and ks[i] < wants[i]:
                    ks[i] += 1
                    spare -= 1
                    given = True
            if not given:
                break
        return ks

    def update(self, request_id: str, proposed: int, accepted: int) -> None:
        """After verification of `proposed` tokens of which the first `accepted` were kept."""
        if proposed <= 0:
            return
        # each draft token up to the first rejection was one acceptance trial
        trials = accepted + (accepted < proposed)
        state = self.state(request_id)
        state.acceptance += self.smoothing * (accepted / trials - state.acceptance)

    def observe_plain(self, num_seqs: int, seconds: float) -> None:
        """Timing of a decode-only step without proposals (the baseline verification is compared with)."""
        old = self._plain_step.get(num_seqs)
        self._plain_step[num_seqs] = seconds if old is None else old + self.smoothing * (seconds - old)

    def observe_cost(self, proposer_seconds: float, draft_steps: int, verify_seconds: float, num_seqs: int = 0,
                     extra_tokens: int = 0) -> None:
        """Timing of one speculative step: `draft_steps` sequential draft forwards, then one verification of
        `num_seqs` sequences carrying `extra_tokens` drafts in all."""
        if draft_steps <= 0 or verify_seconds <= 0:
            return
        # a median, not a moving average: a first draft step pays one-time costs (a server's first request) and
        # reads r ~ 3, which in a moving average holds speculation off while probes nudge it back 20% at a time
        self._draft_samples.append(proposer_seconds / draft_steps / verify_seconds)
        self.draft_cost = statistics.median(self._draft_samples)
        plain = self._plain_step.get(num_seqs)
        if plain and extra_tokens > 0:
            # clamped: on a shared machine one descheduled step can look 10x slower and would switch
            # speculation off for a long time on its own
            v = min(max(0.0, verify_seconds / plain - 1.0) / (extra_tokens / num_seqs), 1.0)
            old = self.verify_cost_at(num_seqs)
            self._verify_costs[num_seqs] = old + self.smoothing * (v - old)
            self._last_batch = num_seqs


@dataclass
class DepthState:
    """What the chooser knows about one draft depth: its acceptance and the time of one of its draft steps."""

    acceptance: float = 0.8
    verifications: int = 0
    step_seconds: deque[float] | None = None  # one draft step / the verification forward it fed, recent steps

    def draft_cost(self) -> float | None:
        return statistics.median(self.step_seconds) if self.step_seconds else None


class DepthChooser:
    """Which of a layer-skipping draft's depths (layers kept) drafts this step, by the policy's cost model.

    A deeper draft agrees with the target more often and costs more per draft step; neither is known before the
    workload runs (an untrained early exit's acceptance depends on the text), so each depth is measured as the
    engine runs: EXPLORE_STEPS verifications each first, in turn, then the depth whose best k gives the largest
    expected speedup E(k) / ((1 + k v) (1 + k r_d)) at its own acceptance a_d and draft cost r_d. One step in
    REPROBE_STEPS goes to the depth measured least recently, so a change of workload can move the choice."""

    EXPLORE_STEPS = 8
    REPROBE_STEPS = 48

    def __init__(self, depths: list[int], policy: SpeculationPolicy | None = None, smoothing: float = 0.1):
        if not depths:
            raise ValueError("a depth chooser needs at least one depth")
        self.depths = sorted(set(depths))
        self.policy = policy
        self.smoothing = smoothing
        self.states = {d: DepthState(step_seconds=deque(maxlen=9)) for d in self.depths}
        self._picks = 0
        self._last_used = {d: 0 for d in self.depths}

    def gain(self, depth: int) -> float:
        """Expected speedup of one verification at this depth's best k; 0 while its cost is unmeasured."""
        state = self.states[depth]
        r = state.draft_cost()
        if r is None:
            return 0.0
        policy = self.policy or SpeculationPolicy(4)
        v = policy.verify_cost
        return max(policy.expected_tokens(state.acceptance, k) / ((1 + k * v) * (1 + k * r))
                   for k in range(1, policy.max_k + 1))

    @property
    def best(self) -> int:
        return max(self.depths, key=lambda d: (self.gain(d), -d))

    def pick(self) -> int:
        """The depth that drafts this step."""
        self._picks += 1
        unexplored = [d for d in self.depths if self.states[d].verifications < self.EXPLORE_STEPS]
        if unexplored:
            depth = unexplored[0]
        elif len(self.depths) > 1 and self._picks % self.REPROBE_STEPS == 0:
            depth = min((d for d in self.depths if d != self.best), key=self._last_used.__getitem__)
        else:
            depth = self.best
        self._last_used[depth] = self._picks
        return depth

    def record(self, depth: int, proposed: int, accepted: int) -> None:
        """One sequence's verification of `proposed` drafts from `depth`, of which the first `accepted` held."""
        if proposed <= 0:
            return
        state = self.states[depth]
        trials = accepted + (accepted < proposed)
        state.acceptance += self.smoothing * (accepted / trials - state.acceptance)
        state.verifications += 1

    def observe(self, depth: int, draft_step_seconds: float, verify_seconds: float) -> None:
        """One step's timing: a draft step at `depth` against the verification forward it fed."""
        if draft_step_seconds > 0 and verify_seconds > 0:
            self.states[depth].step_seconds.append(draft_step_seconds / verify_seconds)
