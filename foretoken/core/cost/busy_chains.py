"""Busy chains: prefill samples from a worker that is never idle (PRODUCT.md §3, issue 15
point 3 "a cold start that does not starve").

Under steady load a worker rarely runs a prompt alone, so cold samples (a request alone on
its worker) are rare — 3 to 14 of 2,000 on long-prompt workloads — and the worker predicts
with the conservative default for most of the run. But while it is busy, the gap between
two consecutive first tokens is the engine's work in between: the next prompt's prefill
(chunks of it, for a chunked engine that shares steps), plus the steps' overhead and
decode. :class:`BusyChains` sums those gaps, per worker, over consecutive first tokens of
requests queued since before the previous one (another prompt whose first token comes in
the same step — the same timestamp — joins with a zero gap), with the prompts' prefill
regressors ``u = Σ(N − K)`` and ``v = Σ(N² − K²)``. A chain whose prompts hold at least
``budgets`` step budgets of new tokens becomes one sample when the next step's first token
comes (so every prompt of its last step is in it), less the overhead and decode of its
steps: at least one per distinct first-token time, and as many as its tokens need at the
step budget left by the requests decoding. A gap that is not a busy one (the request was
sent after the previous first token, or the queue model says admission was blocked —
steps that only decode) starts afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from foretoken.core.types import SchedulerSettings, WorkerId


@dataclass(slots=True)
class _Chain:
    seconds: float = 0.0
    u: float = 0.0
    v: float = 0.0
    longest: float = 0.0  # the largest new-token count of one prompt
    steps: int = 0  # distinct first-token times
    clean: bool = False  # started on an idle engine, timed from the prompt's send
    last_s: float = 0.0  # its latest first token
    step_s: float = 0.0  # a clean chain's step cost and decoders, as it started
    decoding: float = 0.0


@dataclass(frozen=True, slots=True)
class ChainSample:
    """A chain's prefill regressors and time: ``raw_s`` the gaps summed, ``seconds`` less
    ``steps`` steps at the step cost given (``decoding`` requests decoding). The fit
    subtracts again with the step cost current when it answers (the first samples come
    while the step cost is still the default)."""

    u: float
    v: float
    seconds: float
    raw_s: float = 0.0
    steps: int = 0
    decoding: float = 0.0


@dataclass(slots=True)
class BusyChains:
    budgets: float = 1.0
    chains: dict[WorkerId, _Chain] = field(default_factory=dict)

    def drop(self, wid: WorkerId) -> None:
        self.chains.pop(wid, None)

    def has(self, wid: WorkerId) -> bool:
        return wid in self.chains

    def start_clean(
        self, wid: WorkerId, n: int, cached: int, ttft_s: float, ts: float, step_s: float,
        decoding: float,
    ) -> None:  # fmt: skip
        """A first token at ``ts`` of a prompt sent to an idle engine (nothing waiting or
        prefilling; ``decoding`` requests decoding, steps of ``step_s``) ``ttft_s`` before
        it: the engine started on it at its send, so its chain's start is known and it
        needs no step budget of tokens to be a sample (:meth:`close_clean`). Another prompt
        whose first token comes in the same step joins it (:meth:`add`, a zero gap)."""
        chain = _Chain(clean=True, last_s=ts, step_s=step_s, decoding=decoding)
        self.chains[wid] = chain
        _extend(chain, n, cached, ttft_s)

    def close_clean(self, wid: WorkerId, settings: SchedulerSettings,
                    ts: float) -> ChainSample | None:  # fmt: skip
        """A first token at ``ts`` on the worker: a clean chain whose last first token came
        before it has every prompt of its last step in it, and becomes a sample."""
        chain = self.chains.get(wid)
        if chain is None or not chain.clean or not ts > chain.last_s:
            return None
        del self.chains[wid]
        return _sample(chain, settings, chain.step_s, chain.decoding)

    def add(
        self, wid: WorkerId, settings: SchedulerSettings, n: int, cached: int, gap_s: float,
        step_s: float, decoding: float,
    ) -> ChainSample | None:  # fmt: skip
        """A first token ``gap_s`` after the worker's previous one (0: the same step) of a
        prompt of ``n`` tokens, ``cached`` reused. ``step_s``: one decode step's cost with
        ``decoding`` requests decoding. Returns the chain it completed, if any."""
        chain = self.chains.get(wid)
        sample = None
        if (
            chain is not None
            and gap_s > 0
            and chain.u >= self.budgets * settings.max_num_batched_tokens
        ):
            sample = _sample(chain, settings, step_s, decoding)
            chain = None
        if chain is None:
            chain = self.chains[wid] = _Chain()
        _extend(chain, n, cached, gap_s)
        return sample


def _extend(chain: _Chain, n: int, cached: int, gap_s: float) -> None:
    k = min(max(cached, 0), n)
    chain.seconds += gap_s
    chain.u += n - k
    chain.v += n * n - k * k
    chain.longest = max(chain.longest, n - k)
    chain.steps += gap_s > 0


def alone_sample(
    settings: SchedulerSettings, n: int, cached: int, ttft_s: float, step_s: float
) -> ChainSample | None:
    """A prompt that ran alone (a cold sample, ``cached`` reused) as a one-prompt chain:
    its TTFT less the overhead of the steps its prefill took, the part the queue walk adds
    on top of ``C(N) − C(K)`` (kept in, a short prompt's sample would read the step's
    overhead as prefill: 14 ms of a 25 ms TTFT on 374 tokens doubles ``a``)."""
    k = min(max(cached, 0), n)
    chain = _Chain(seconds=ttft_s, u=n - k, v=n * n - k * k, longest=n - k, steps=1)
    return _sample(chain, settings, step_s, 0.0) if n > k else None


def _sample(
    chain: _Chain, settings: SchedulerSettings, step_s: float, decoding: float
) -> ChainSample | None:
    budget = settings.max_num_batched_tokens
    cap = settings.long_prefill_token_threshold or budget
    steps = max(
        -(-int(chain.u) // max(budget - int(decoding), 1)),
        -(-int(chain.longest) // max(min(cap, budget), 1)),
        chain.steps,
    )
    seconds = chain.seconds - steps * step_s
    if not chain.seconds > 0:
        return None
    return ChainSample(chain.u, chain.v, seconds, chain.seconds, steps, decoding)
