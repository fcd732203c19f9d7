"""Busy chains: prefill samples from a worker that is never idle (PRODUCT.md §3, issue 15
point 3 "a cold start that does not starve").

Under steady load a worker rarely runs a prompt alone, so cold samples (a request alone on
its worker) are rare — 3 to 14 of 2,000 on long-prompt workloads — and the worker predicts
with the conservative default for most of the run. But while it is busy, the gap between
two consecutive first tokens is the engine's work in between: the next prompt's prefill
(chunks of it, for a chunked engine that shares steps), plus the steps' overhead and
decode. :class:`BusyChains` sums those gaps, per worker, over consecutive first tokens of
requests queued since before the previous one (another prompt whose first token comes in
the same step — within ``SAME_STEP_S`` of the previous one — joins with a zero step), with
the prompts' prefill regressors ``u = Σ(N − K)`` and ``v = Σ(N² − K²)``. A chain whose
prompts hold at least ``budgets`` step budgets of new tokens becomes one sample when the
next step's first token comes (so every prompt of its last step is in it), less the
overhead and decode of its steps: at least one per distinct first-token time, and as many
as its tokens need at the step budget left by the requests decoding. A gap that is not a
busy one (the request was sent after the previous first token, or the queue model says
admission was blocked — steps that only decode) starts afresh.

Where a chain ends matters: the steps of its last gap also carry chunks of the prompts
still prefilling, whose tokens are not in it. On a chunked engine with a per-prompt chunk
cap, several long prompts share every step, and a chain of one or two of them read the
others' chunks as its own (``a`` 1.5–2× too high on the ``demo`` fleet's 1,024-token caps).
So a chain also ends where that cannot happen: at a first token after which no request
sent before it waits for its own (``drained``) — the worker's queue is empty of prefill
work, every step of the chain held only its prompts. A **clean** chain (started by a prompt
sent to an idle engine, timed from its send: its start is exact too) waits for such an end
— requests sent after it share its first steps, their first tokens come later — and becomes
the exact sample of every prompt in it, whatever its size (past ``CLEAN_BUDGETS`` budgets it
gives up waiting and ends as a busy chain does).

A burst on an idle engine whose first first token is not the first prompt's (a shorter
one overtook it) starts no chain; the learner takes that first token as a sample of its
own instead, from a replay of the burst's scheduler (:mod:`foretoken.core.queue.burst`).

Overtaking: on an engine whose long-prefill threshold is below its step budget, a long
prompt prefills beside shorter prompts sent after it, and their first tokens come first.
A chain does not end at a first token of a prompt that overtook another still waiting
(``overtook``): the steps so far carried the overtaken prompt's chunks, so the chain goes
on until that prompt is in it. And the overtaken prompt does not start a chain of its own
(the learner's rule): its first token ends a gap that holds only its last steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from foretoken.core.types import SchedulerSettings, WorkerId

# Two first tokens this close are of one step: the router reads each stream on its own, and
# one step's first tokens reach it a fraction of a millisecond apart (half a decode step at
# most, for a fleet of very short steps).
SAME_STEP_S = 0.002
# A clean chain stops waiting for a drained queue past this many budgets of ``budgets``.
CLEAN_BUDGETS = 4.0


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
    overtaken: bool = False  # at its latest first token, a prompt sent before it still waited


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
    # Its start and its prompts are known exactly: a prompt alone from a known start, or a
    # clean chain that ran until nothing sent waited (no other prompt's chunk in its steps).
    exact: bool = False


@dataclass(slots=True)
class BusyChains:
    budgets: float = 1.0
    chains: dict[WorkerId, _Chain] = field(default_factory=dict)

    def drop(self, wid: WorkerId) -> None:
        self.chains.pop(wid, None)

    def has(self, wid: WorkerId) -> bool:
        return wid in self.chains

    def is_clean(self, wid: WorkerId) -> bool:
        """Whether the worker's chain is a clean one still waiting for its prompts."""
        chain = self.chains.get(wid)
        return chain is not None and chain.clean

    def start_clean(
        self, wid: WorkerId, settings: SchedulerSettings, n: int, cached: int, ttft_s: float,
        ts: float, step_s: float, decoding: float, drained: bool = False,
    ) -> ChainSample | None:  # fmt: skip
        """The first token of a prompt sent to an idle engine (nothing waiting or
        prefilling; ``decoding`` requests decoding, steps of ``step_s``) ``ttft_s`` after
        its send: the engine started on it then, so its chain's start is known. Its sample
        when nothing sent before this first token still waits for one (``drained``: no
        other prompt shared its steps); else it waits for the prompts that did (:meth:`add`)."""
        chain = _Chain(clean=True, last_s=ts, step_s=step_s, decoding=decoding)
        self.chains[wid] = chain
        _extend(chain, n, cached, ttft_s, False)
        return self._end_clean(wid, chain, settings, exact=True) if drained else None

    def close_clean(self, wid: WorkerId, settings: SchedulerSettings,
                    ts: float) -> ChainSample | None:  # fmt: skip
        """An outcome at ``ts`` on a worker that cannot wait for a drained queue (``settle``
        off, :meth:`add`): a clean chain whose last first token came before it has every
        prompt of its first step in it, and becomes a sample."""
        chain = self.chains.get(wid)
        if chain is None or not chain.clean or not ts > chain.last_s + SAME_STEP_S:
            return None
        return self._end_clean(wid, chain, settings)

    def add(
        self, wid: WorkerId, settings: SchedulerSettings, n: int, cached: int, gap_s: float,
        step_s: float, decoding: float, drained: bool = False, settle: bool = True,
        overtook: bool = False,
    ) -> ChainSample | None:  # fmt: skip
        """A first token ``gap_s`` after the worker's previous one (0: the same step) of a
        prompt of ``n`` tokens, ``cached`` reused. ``step_s``: one decode step's cost with
        ``decoding`` requests decoding. ``drained``: no request sent before it is still
        waiting for its first token. ``settle``: a clean chain waits for a drained queue;
        else (a worker without a fit yet, which cannot wait) it ends at its first step's
        first tokens, as its steps may also have carried chunks of others. Returns the
        chain it completed, if any. ``overtook``: a request sent before this one still
        waits for its first token — this prompt overtook it (a long prompt capped at the
        long-prefill threshold, sharing steps with shorter ones), so the steps so far also
        carried chunks of that prompt: the chain may not end here, it goes on until the
        overtaken prompt's first token is in it."""
        chain = self.chains.get(wid)
        same = gap_s <= min(SAME_STEP_S, 0.5 * step_s)
        budget = self.budgets * settings.max_num_batched_tokens
        sample = None
        if chain is not None and chain.clean and (settle or same):
            _extend(chain, n, cached, gap_s, same)
            chain.last_s += gap_s
            if drained:
                return self._end_clean(wid, chain, settings, exact=True)
            if chain.u >= CLEAN_BUDGETS * budget:
                chain.clean = False  # too long to wait for: it ends as a busy chain does
            return None
        if chain is not None and chain.clean:  # a later step: it ends here, this one goes on
            sample, chain = self._end_clean(wid, chain, settings), None
        if chain is not None and not same and chain.u >= budget and not chain.overtaken:
            sample = _sample(chain, settings, step_s, decoding)
            chain = None
        if chain is None:
            chain = self.chains[wid] = _Chain()
        _extend(chain, n, cached, gap_s, same)
        chain.overtaken = overtook
        if drained:  # the next first token will not be a busy one: nothing to wait for
            del self.chains[wid]
        return sample

    def _end_clean(self, wid: WorkerId, chain: _Chain, settings: SchedulerSettings,
                   exact: bool = False) -> ChainSample | None:  # fmt: skip
        del self.chains[wid]
        return _sample(chain, settings, chain.step_s, chain.decoding, exact)


def _extend(chain: _Chain, n: int, cached: int, gap_s: float, same_step: bool) -> None:
    k = min(max(cached, 0), n)
    chain.seconds += gap_s
    chain.u += n - k
    chain.v += n * n - k * k
    chain.longest = max(chain.longest, n - k)
    chain.steps += not same_step


def alone_sample(
    settings: SchedulerSettings, n: int, cached: int, ttft_s: float, step_s: float,
    decoding: float = 0.0,
) -> ChainSample | None:  # fmt: skip
    """A prompt that prefilled alone (a cold sample, ``cached`` reused; or one admitted
    alone beside ``decoding`` requests decoding, timed from its admission) as a one-prompt
    chain: its time less the steps its prefill took, the part the queue walk adds on top
    of ``C(N) − C(K)`` (kept in, a short prompt's sample would read the step's overhead as
    prefill: 14 ms of a 25 ms TTFT on 374 tokens doubles ``a``)."""
    k = min(max(cached, 0), n)
    chain = _Chain(seconds=ttft_s, u=n - k, v=n * n - k * k, longest=n - k, steps=1)
    return _sample(chain, settings, step_s, decoding, exact=True) if n > k else None


def _sample(
    chain: _Chain, settings: SchedulerSettings, step_s: float, decoding: float,
    exact: bool = False,
) -> ChainSample | None:  # fmt: skip
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
    return ChainSample(chain.u, chain.v, seconds, chain.seconds, steps, decoding, exact)
