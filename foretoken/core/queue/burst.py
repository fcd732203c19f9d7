"""The prefill work of a burst: what an engine idle at ``start_s`` computed until the first
first token of the prompts sent to it since (issue 15, "a cold start that does not starve").

A fresh worker that receives a burst never idles again, and with a long-prefill threshold
below its step budget its first first token belongs to a short prompt that shared every
step with the others: no clean chain (:mod:`foretoken.core.cost.busy_chains`) ends there,
and busy chains need several budgets each — `bursty/random-1/1.3` had its first sample
after 80 of a worker's 84 predictions (docs/BENCHMARKS.md). But the tokens each step
prefilled are set by the scheduler's rules (budget, chunk cap, seats) and the send times,
not by the cost, except for which step each prompt arrived in. :func:`burst_work` replays
the scheduler over the sends and returns the regressors of that work — ``u = Σ chunk
tokens``, ``v = Σ (end² − start²)`` — with its steps and decoders, so that the time from
the first send to the first token is ``steps·overhead + per_seq·decoders + a·u + b·v``.
:func:`burst_sample` solves that for ``a`` (the alignment of arrivals to steps depends on
``a``: a fixed point, a few replays) and checks that in the replay no other prompt's first
token came in an earlier step than the one seen.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from foretoken.core.queue.scheduler import (
    CurveStepCost,
    KvModel,
    Stretch,
    _Scheduler,
    _Seq,
    prefill_span,
)
from foretoken.core.types import SchedulerSettings

# Replays of the fixed point, and the relative change of ``a`` that ends it.
MAX_ROUNDS = 6
TOLERANCE = 0.01


@dataclass(frozen=True, slots=True)
class Sent:
    """One prompt sent since the engine was idle: when, its size, its credited cache."""

    sent_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class BurstWork:
    u: float  # prompt tokens prefilled, all prompts
    v: float  # Σ (end² − start²) of their chunks
    steps: int
    decoders: float  # decoders served, summed over the steps
    seconds: float  # the replay's time from the first send to the target's first token
    first: bool  # no other prompt's prefill completed in an earlier step


def burst_work(settings: SchedulerSettings, kv: KvModel | None, sent: Sequence[Sent],
               target: int, cost: CurveStepCost) -> BurstWork | None:  # fmt: skip
    """Replay an idle engine receiving ``sent`` (ordered by send) until the prefill of
    ``sent[target]`` completes; None if the replay stalls."""
    scheduler = _Scheduler(settings, retire=True, kv=kv)
    record: list[Stretch] = []
    scheduler.record = record
    start_s = sent[0].sent_s
    scheduler.free_at_s = start_s
    seqs: list[_Seq] = []
    first_done_s = math.inf  # the end of the first step that completed a prefill
    while True:
        now_s = scheduler.free_at_s
        while len(seqs) < len(sent) and sent[len(seqs)].sent_s <= now_s:
            s = sent[len(seqs)]
            lo, prompt = prefill_span(s.prompt_tokens, s.cached_tokens)
            seq = _Seq(lo, lo, prompt, max(s.output_tokens, 1), len(seqs))
            seq.blocks = scheduler.blocks_of(seq, s.output_tokens)
            scheduler.waiting.append(seq)
            seqs.append(seq)
        if first_done_s == math.inf and any(q.computed >= q.end for q in seqs):
            first_done_s = now_s
        if target < len(seqs) and seqs[target].computed >= seqs[target].end:
            break
        until = sent[len(seqs)].sent_s if len(seqs) < len(sent) else math.inf
        if not scheduler.run_stretch(cost, until):
            if until == math.inf:
                return None
            scheduler.free_at_s = max(scheduler.free_at_s, until)
    return _work(record, cost, scheduler.free_at_s - start_s, first_done_s >= scheduler.free_at_s)


def _work(record: list[Stretch], cost: CurveStepCost, seconds: float, first: bool) -> BurstWork:
    u = v = decoders = 0.0
    steps = 0
    per_seq = cost.decode_s_per_seq
    for st in record:
        steps += st.steps
        if per_seq > 0:
            decoders += st.steps * max(round((st.per_step_s - cost.step_overhead_s) / per_seq), 0)
        for computed, size in st.chunks:
            end = computed + st.steps * size
            u += end - computed
            v += end * end - computed * computed
    return BurstWork(u, v, steps, decoders, seconds, first)


def burst_sample(settings: SchedulerSettings, kv: KvModel | None, sent: Sequence[Sent],
                 target: int, seconds: float, a: float, b: float, overhead_s: float,
                 per_seq_s: float) -> BurstWork | None:  # fmt: skip
    """The burst's work at the ``a`` that makes the replay's first token of
    ``sent[target]`` come ``seconds`` after the first send (from ``a`` as the first guess,
    ``b`` and the step cost fixed); None where that cannot be trusted: no positive
    solution, no convergence, or a replay whose first completed prompt is another one."""
    if not (seconds > 0 and a > 0 and sent) or not 0 <= target < len(sent):
        return None
    for _ in range(MAX_ROUNDS):
        cost = CurveStepCost(_curve(a, b), overhead_s, per_seq_s, (a, b))
        work = burst_work(settings, kv, sent, target, cost)
        if work is None or work.u <= 0:
            return None
        steps_s = work.steps * overhead_s + work.decoders * per_seq_s
        solved = (seconds - steps_s - b * work.v) / work.u
        if not solved > 0:
            return None
        if abs(solved - a) <= TOLERANCE * a:
            return work if work.first else None
        a = solved
    return None


def _curve(a: float, b: float) -> Callable[[int], float]:
    def cost_s(n: int) -> float:
        return n * (a + b * n)

    return cost_s
