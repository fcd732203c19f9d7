"""An engine that keeps a log of what it really did, to *grade* predictions by their parts.

:class:`TracedEngine` is :class:`~foretoken.sim.engine.EngineModel` plus a log of every
step it ran: start, end, the noise factor and stall it drew, and the noiseless cost of
each part (step overhead, decode per sequence and per context token, each request's
prefill chunk and tier load). It changes nothing the engine does (same draws, same
order), so a replay with it gives the same records.

:meth:`TracedEngine.truth_parts` splits a served request's real TTFT over the steps
between its arrival and its first token: the remainder of the step in progress at its
arrival (``residual``), step overheads, decode of the others, the others' prefill chunks
(``prefill_ahead``), its own prefill and tier load, stalls and idle time. Only a grader
reads this (``foretoken bench predict --explain``); no policy ever sees it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from foretoken.core.types import RequestId
from foretoken.sim.engine import EngineModel, StepResult
from foretoken.sim.prefix_cache import KvEventDetail
from foretoken.sim.spec import EngineSpec

EPS_S = 1e-12
Chunk = tuple[RequestId, int, float, float]  # request, tokens, chunk cost, load cost


@dataclass(slots=True)
class StepLog:
    start: list[float] = field(default_factory=list)
    end: list[float] = field(default_factory=list)
    mult: list[float] = field(default_factory=list)  # noise factor drawn
    stall: list[float] = field(default_factory=list)
    overhead: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)  # per-seq + per-context-token terms
    prefill: list[float] = field(default_factory=list)  # Σ chunk costs, loads included
    chunks: dict[int, tuple[Chunk, ...]] = field(default_factory=dict)  # by step index


class TracedEngine(EngineModel):
    """The engine with a step log (module doc)."""

    def __init__(self, spec: EngineSpec, *, kv_events: KvEventDetail = "full") -> None:
        super().__init__(spec, kv_events=kv_events)
        self.log = StepLog()
        self._draws: list[tuple[float, float, bool]] = []
        self._plan: list[Any] = []
        self.arrival: dict[RequestId, float] = {}
        self.first_token_at: dict[RequestId, float] = {}

    def submit(self, request_id, token_ids, max_tokens, now_s):
        super().submit(request_id, token_ids, max_tokens, now_s)
        self.arrival[request_id] = now_s

    def _perturb(self, duration_s: float) -> tuple[float, bool]:
        d, stalled = super()._perturb(duration_s)
        self._draws.append((duration_s, d, stalled))
        return d, stalled

    def _duration_s(self, plan):
        self._plan = list(plan)
        return super()._duration_s(plan)

    def _record(self, start: float, end: float, decode: float, chunks: tuple[Chunk, ...]) -> None:
        noiseless, d, stalled = self._draws[-1]
        log, truth = self.log, self._truth
        stall = truth.stall_s if stalled else 0.0
        log.mult.append((d - stall) / noiseless if noiseless > 0 else 1.0)
        if chunks:
            log.chunks[len(log.start)] = chunks
        log.start.append(start)
        log.end.append(end)
        log.stall.append(stall)
        log.overhead.append(truth.step_overhead_s)
        log.decode.append(decode)
        log.prefill.append(sum(c[2] + c[3] for c in chunks))

    def step(self, now_s: float) -> StepResult:
        self._draws.clear()
        result = super().step(now_s)
        if not result.chunks:
            return result
        truth = self._truth
        decoders = context = 0
        chunks: list[Chunk] = []
        for request, start, num, prefill, load_s in self._plan:
            if prefill:
                chunks.append((request.request_id, num, truth.chunk_prefill_s(start, start + num),
                               load_s))  # fmt: skip
            else:
                decoders += 1
                context += start + num
        decode = decoders * truth.decode_s_per_seq + context * truth.decode_s_per_context_token
        self._record(now_s, result.end_s, decode, tuple(chunks))
        for first in result.first_tokens:
            self.first_token_at[first.request_id] = first.time_s
        return result

    def _run_times(self, now_s, until_s, size, first_context, steps_left):
        self._draws.clear()
        ends, stalls = super()._run_times(now_s, until_s, size, first_context, steps_left)
        draws, truth = list(self._draws), self._truth
        start, context = now_s, first_context
        for draw, end in zip(draws, ends, strict=True):
            self._draws[:] = [draw]
            decode = size * truth.decode_s_per_seq + context * truth.decode_s_per_context_token
            self._record(start, end, decode, ())
            start, context = end, context + size
        return ends, stalls

    # ------------------------------------------------------------------ truth

    def truth_parts(self, rid: RequestId) -> dict[str, float]:
        """The real TTFT of ``rid`` split over the steps of its wait (module doc)."""
        log = self.log
        a, f = self.arrival[rid], self.first_token_at[rid]
        i = bisect.bisect_right(log.end, a + EPS_S)  # the first step ending after the arrival
        out = dict(residual=0.0, overhead=0.0, decode=0.0, prefill_ahead=0.0, own=0.0,
                   load=0.0, stall=0.0, steps=0.0)  # fmt: skip
        busy = 0.0
        while i < len(log.start) and log.start[i] < f - EPS_S:
            s, e, m = log.start[i], log.end[i], log.mult[i]
            busy += e - max(s, a)
            if s < a - EPS_S:
                out["residual"] += e - a
                i += 1
                continue
            out["steps"] += 1
            out["overhead"] += m * log.overhead[i]
            out["decode"] += m * log.decode[i]
            out["stall"] += log.stall[i]
            mine = [c for c in log.chunks.get(i, ()) if c[0] == rid]
            own = sum(c[2] for c in mine)
            load = sum(c[3] for c in mine)
            out["own"] += m * own
            out["load"] += m * load
            out["prefill_ahead"] += m * (log.prefill[i] - own - load)
            i += 1
        out["idle"] = (f - a) - busy
        out["ttft"] = f - a
        return out
