"""The long-lived services keep their records out of the garbage collector's passes
(``foretoken/adapters/heap.py``): the records they hold by the hundred thousand are not
tracked, and what a started service holds is frozen out of full collections."""

from __future__ import annotations

import gc
import inspect

import msgspec
import pytest

from foretoken.adapters.heap import freeze_startup_heap
from foretoken.core import types
from foretoken.core.types import CandidatePrediction, FitUsed
from foretoken.wire import records
from foretoken.wire.records import Grant, Outcome


def _grant(i: int) -> Grant:
    candidates = tuple(
        CandidatePrediction(
            worker_id=f"w{j}",
            predicted_ttft_s=1.0 + j,
            queue_wait_s=0.5,
            prefill_s=0.5,
            cached_tokens=16 * j,
        )
        for j in range(16)
    )
    return Grant(request_id=f"r{i}", ts=1.0, model="m", prompt_tokens=1000, admitted=True,
                 worker_id="w0", predicted_ttft_s=1.0, candidates=candidates,
                 fit=FitUsed(a=1e-5, b=1e-10, samples=3, version=1, default=False))  # fmt: skip


@pytest.mark.parametrize("module", [types, records])
def test_every_record_struct_is_untracked(module: object) -> None:
    """A record type added without ``gc=False`` would put its instances back into every
    collection: each struct of the record modules is checked, not a list of names."""
    structs = [
        cls for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, msgspec.Struct) and cls.__module__ == module.__name__  # type: ignore[attr-defined]
    ]  # fmt: skip
    assert len(structs) >= 9
    tracked = [cls.__name__ for cls in structs if cls.__struct_config__.gc]
    assert tracked == []


def test_kept_decisions_cost_a_full_collection_nothing() -> None:
    """100,000 decisions with 16 candidates each, as the route service keeps them: none of
    their ~1.8 M objects is walked by a collection (the tuples of candidates are untracked
    by the first pass that sees them)."""
    kept = {f"r{i}": _grant(i) for i in range(100_000)}
    outcome = Outcome(request_id="r0", ts=2.0, kind="first_token", worker_id="w0",
                      actual_ttft_s=0.5)  # fmt: skip
    gc.collect()
    assert not gc.is_tracked(kept["r7"]) and not gc.is_tracked(outcome)
    assert not gc.is_tracked(kept["r7"].candidates[3])
    assert not gc.is_tracked(kept["r7"].candidates)  # untracked by the collection above
    held = sum(1 for o in gc.get_objects() if isinstance(o, (Grant, CandidatePrediction)))
    assert held == 0  # tracked, they made each full collection ~0.5 s (BENCHMARKS.md)


def test_freeze_moves_the_started_heap_out_of_collections() -> None:
    gc.unfreeze()
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > 1000  # the interpreter's and the imports'
        before = len(gc.get_objects())
        assert before < frozen  # what collections still walk: made since the freeze
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
