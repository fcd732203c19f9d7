"""The queue's recorded future, replayed and walked in Rust (``foretoken_native.QueueFuture``,
``native/src/queue/``): the same steps, the same floating-point operations in the same
order as :class:`~foretoken.core.queue.future.Future` over the scheduler of
:mod:`foretoken.core.queue.scheduler`, so the predictions are bit-identical
(``tests/unit/core/queue/test_native_walk.py``).

The seam stays the Python interface: a cost is walked natively only when it says it is the
quadratic prefill curve ``C(N) = N·(a + b·N)`` plus step overhead and per-sequence decode
(:attr:`~foretoken.core.queue.scheduler.CurveStepCost.quadratic`, set for the fitted curves
by :func:`foretoken.core.routing.predict.step_cost`); any other cost model (a colleague's new
one, a test's lambda) is replayed and walked by the Python reference, and so is every
walk once the Python queue model has anything the port does not know (:data:`MODELED`).
Pure like the index wrapper (:mod:`foretoken.core.index.native`): the extension does no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from itertools import compress
from operator import itemgetter
from typing import Any

from foretoken.core.queue.scheduler import (
    MIN_OUTPUT_TOKENS_LEFT,
    CurveStepCost,
    KvModel,
    NewRequest,
    QueuePrediction,
    StepCost,
    Stretch,
    _Scheduler,
    _Seq,
)
from foretoken.core.queue.tails import tail_done
from foretoken.core.types import SchedulerSettings

try:
    import foretoken_native as _native
except ImportError:  # pragma: no cover - the build installs it; the Python walk remains
    _native = None

# (computed, end, output tokens left, admission order, KV blocks) of a partial prefill;
# (order, step of its last token, KV blocks) of a decoder; (computed, end, output tokens
# left, KV blocks) of a waiting one.
Prefilling = tuple[int, int, int, int, int]
Decoder = tuple[int, int, int]
Waiting = tuple[int, int, int, int]

# What the port models: the Python queue model's settings, step cost, KV model, sequence and
# scheduler state, new request and stretch as they were when native/src/queue/ was last
# brought level. When the Python model gains anything (a setting, a cost term, a field of a
# sequence or of the scheduler), MODELED is False and every walk runs on the Python
# reference until the port is brought level (tests/unit/core/queue/test_native_walk.py
# then skips, saying so).
PORTED = {
    "settings": frozenset(
        {"max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold",
         "chunked_prefill"}
    ),
    "cost": frozenset({"prefill_s", "step_overhead_s", "decode_s_per_seq", "quadratic"}),
    "kv": frozenset({"gpu_blocks", "block_size"}),
    "new_request": frozenset({"prompt_tokens", "cached_tokens", "output_tokens",
                              "pinned_tokens"}),
    "stretch": frozenset({"start_s", "steps", "per_step_s", "chunks", "budget_left", "running",
                          "waiting", "kv_used"}),
    # done_s (when the estimate finished a prefill) and tail (an answer's learned length)
    # are read by the hand-over here, in Python (record_estimate): the crate's replay
    # takes the result (seen decoders, their last steps), not the fields.
    "seq": frozenset({"blocks", "computed", "done_s", "end", "expected", "first", "key", "left",
                      "order", "seen", "tail", "where"}),
    "scheduler": frozenset(
        {"budget", "max_seqs", "chunked", "cap", "retire", "prefilling", "dec_orders",
         "dec_done", "dec_seqs", "waiting", "free_at_s", "steps", "next_order", "record",
         "kv", "kv_cap", "kv_used"}
    ),
}  # fmt: skip


def python_model() -> dict[str, frozenset[str]]:
    """The same names, read off the Python queue model as it is now."""
    return {
        "settings": frozenset(SchedulerSettings.__struct_fields__),
        "cost": frozenset(f.name for f in fields(CurveStepCost)),
        "kv": frozenset(f.name for f in fields(KvModel)),
        "new_request": frozenset(NewRequest.__struct_fields__),
        "stretch": frozenset(f.name for f in fields(Stretch)),
        "seq": frozenset(_Seq.__slots__),
        "scheduler": frozenset(vars(_Scheduler(SchedulerSettings(), retire=False))),
    }


MODELED: bool = _native is not None and python_model() == PORTED


def coefficients(cost: StepCost) -> tuple[float, float, float, float] | None:
    """``(a, b, step overhead, decode per sequence)`` when the native walk may take
    ``cost`` (a :class:`CurveStepCost` marked quadratic, a model the port knows), else None."""
    if not MODELED or type(cost) is not CurveStepCost or cost.quadratic is None:
        return None
    a, b = cost.quadratic
    return (a, b, cost.step_overhead_s, cost.decode_s_per_seq)


def record_estimate(
    source: _Scheduler, settings: SchedulerSettings, now_s: float, cost: StepCost,
    lag_s: float = 0.0, *, tails: bool = False,
) -> NativeFuture | None:  # fmt: skip
    """The recorded future of an in-flight estimate's scheduler (``source``, ``retire=False``),
    replayed natively; None when the native walk does not model ``cost`` (or the queue
    model), and the caller replays it in Python.

    The hand-over is ``InFlightEstimate._replay_copy`` as plain tuples: a running sequence
    without a first token keeps its last chunk and all its output; decoders whose first
    token was not seen yet prefill again (the estimate ran ahead of the engine); decoders
    that outlived their estimate have one token left, unless they carry a tail (``tails``:
    some may; ``tails.py``); every sequence keeps its KV blocks, and the running ones' are
    reserved. ``lag_s``: a decoder whose prefill the estimate finishes after
    ``now_s − lag_s`` counts as seen (its first token due, or on its way)."""
    quadratic = coefficients(cost)
    if quadratic is None:
        return None
    min_chunk = source.min_chunk
    prefilling = [(min(s.computed, s.end - min_chunk(s)), s.end, s.expected, s.order, s.blocks)
                  for s in source.prefilling]  # fmt: skip
    orders, done, decs = source.dec_orders, source.dec_done, source.dec_seqs
    seen = [s.seen or now_s < s.done_s + lag_s for s in decs]
    if not all(seen):
        prefilling += [(min(s.computed, s.end - min_chunk(s)), s.end, s.expected, s.order,
                        s.blocks) for s, k in zip(decs, seen, strict=True) if not k]  # fmt: skip
        prefilling.sort(key=_ORDER)
        orders, done = list(compress(orders, seen)), list(compress(done, seen))
        decs = list(compress(decs, seen))
    base = source.steps
    if tails:
        done = tail_done(decs, done, base)
    if done and min(done) < base + MIN_OUTPUT_TOKENS_LEFT:
        done = [max(d, base + MIN_OUTPUT_TOKENS_LEFT) for d in done]
    blocks = [s.blocks for s in decs]
    waiting = [(s.computed, s.end, s.expected, s.blocks) for s in source.waiting]
    tokens_ahead = sum(p[1] - p[0] for p in prefilling) + sum(w[1] - w[0] for w in waiting)
    # a prefill whose last step is still under way: its last chunk is being computed
    tokens_ahead += sum(min_chunk(s) for s in source.dec_seqs if not s.seen and now_s < s.done_s)
    kv_used = sum(p[4] for p in prefilling) + sum(blocks)
    try:
        return NativeFuture.record(
            settings, cost, quadratic, source.kv, free_at_s=source.free_at_s, steps=base,
            next_order=source.next_order, prefilling=prefilling,
            decoders=list(zip(orders, done, blocks, strict=True)), waiting=waiting,
            now_s=now_s, tokens_ahead=tokens_ahead, kv_used=kv_used,
        )  # fmt: skip
    except OverflowError:  # step counts past 64 bits (a cost of ~0 s per step): Python's ints
        return None


_ORDER = itemgetter(3)


def _settings(settings: SchedulerSettings) -> tuple[int, int, bool, int]:
    return (
        settings.max_num_batched_tokens,
        settings.max_num_seqs,
        settings.chunked_prefill,
        settings.long_prefill_token_threshold,
    )


def _kv(kv: KvModel | None) -> tuple[int, int] | None:
    return None if kv is None else (kv.gpu_blocks, kv.block_size)


class NativeFuture:
    """A :class:`~foretoken.core.queue.future.Future` recorded natively: the same
    ``first_token`` / ``drain_s`` (and, materialized on demand, the same stretches)."""

    __slots__ = ("_future", "cost", "kv", "settings")

    def __init__(
        self, future: Any, settings: SchedulerSettings, cost: StepCost, kv: KvModel | None
    ) -> None:
        self._future, self.settings, self.cost, self.kv = future, settings, cost, kv

    @classmethod
    def record(
        cls,
        settings: SchedulerSettings,
        cost: StepCost,
        coefficients: tuple[float, float, float, float],
        kv: KvModel | None = None,
        *,
        free_at_s: float,
        steps: int,
        next_order: int,
        prefilling: Sequence[Prefilling],
        decoders: Sequence[Decoder],
        waiting: Sequence[Waiting],
        now_s: float,
        tokens_ahead: int,
        kv_used: int = 0,
    ) -> NativeFuture:
        """Replay the queue (a replay of the future: sequences leave after their last
        token) to its end from ``now_s`` or the end of its current step."""
        assert _native is not None
        future = _native.QueueFuture.record(
            _settings(settings), coefficients, _kv(kv), free_at_s, steps, next_order,
            prefilling, decoders, waiting, now_s, tokens_ahead, kv_used,
        )  # fmt: skip
        return cls(future, settings, cost, kv)

    @classmethod
    def from_stretches(
        cls,
        settings: SchedulerSettings,
        cost: StepCost,
        coefficients: tuple[float, float, float, float],
        kv: KvModel | None = None,
        *,
        ready_s: float,
        start_s: float,
        stretches: Sequence[Stretch],
        end_s: float,
        drained_s: float | None,
        tokens_ahead: int,
    ) -> NativeFuture:
        """A native future over stretches recorded elsewhere (the Python replay's)."""
        assert _native is not None
        rows = [
            (s.start_s, s.steps, s.per_step_s, list(s.chunks), s.budget_left, s.running,
             s.waiting, s.kv_used)
            for s in stretches
        ]  # fmt: skip
        future = _native.QueueFuture.from_stretches(
            _settings(settings), coefficients, _kv(kv), ready_s, start_s, rows, end_s,
            drained_s, tokens_ahead,
        )  # fmt: skip
        return cls(future, settings, cost, kv)

    def first_token(self, new_request: NewRequest, now_s: float) -> QueuePrediction:
        wait, prefill, ttft, steps, ahead = self._future.first_token(
            new_request.prompt_tokens, new_request.cached_tokens, new_request.pinned_tokens,
            new_request.output_tokens,
            now_s,
        )  # fmt: skip
        return QueuePrediction(wait, prefill, ttft, steps, ahead)

    def drain_s(self, now_s: float) -> float:
        drain: float = self._future.drain_s(now_s)
        return drain

    @property
    def ready_s(self) -> float:
        value: float = self._future.ready_s
        return value

    @property
    def start_s(self) -> float:
        value: float = self._future.start_s
        return value

    @property
    def end_s(self) -> float:
        value: float = self._future.end_s
        return value

    @property
    def drained_s(self) -> float | None:
        value: float | None = self._future.drained_s
        return value

    @property
    def tokens_ahead(self) -> int:
        value: int = self._future.tokens_ahead
        return value

    @property
    def stretches(self) -> tuple[Stretch, ...]:
        return tuple(
            Stretch(start, steps, per, tuple(map(tuple, chunks)), left, running, waiting, kv)
            for start, steps, per, chunks, left, running, waiting, kv in self._future.stretches()
        )
