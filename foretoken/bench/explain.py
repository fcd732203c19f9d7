"""`foretoken bench predict --explain`: each prediction's error split into its parts.

One replay per load of a (trace, fleet) cell (:mod:`foretoken.bench.accuracy`: same
workload, calibration and speedup), the cold-start predictor routing. Two sides:

* **predicted** — when the predictor predicts for the worker it then chooses, the
  worker's recorded queue future (:class:`foretoken.core.queue.future.Future`) is walked
  exactly as :meth:`~foretoken.core.queue.future.Future.first_token` walks it, adding up
  what the predictor believes: the rest of the step in progress (``residual``), the step
  overheads, the decode of the sequences it believes run, the prefill of the requests
  ahead, then its own prefill and tier load. ``other`` is what the walk leaves to the
  total (≈ 0, or the clamp of TTFT at the own prefill);
* **true** — the simulator's step log (:class:`foretoken.sim.traced.TracedEngine`),
  split the same way over the steps between the request's arrival and its first token
  (``other`` = residual + stalls + idle time).

The truth is read only here, to grade; it never reaches the predictor. ``queue_wait`` is
TTFT − own prefill − load on both sides. Every served request gets a record
(``records``: predicted and true parts), and ``summary`` gives, per load and part, the
mean predicted and true seconds, the mean and median signed error and the p95 of the
absolute error.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from foretoken.bench.accuracy import SEED, cell_inputs, prepare
from foretoken.core.queue.future import Future
from foretoken.core.queue.scheduler import NewRequest, pinned_prefix, prefill_span
from foretoken.core.routing.predict import step_cost
from foretoken.core.types import RequestId, WorkerId
from foretoken.settings import load_settings
from foretoken.sim.predictor_policy import PredictorPolicy
from foretoken.sim.replay import EPOCH_BASE_TS, replay
from foretoken.sim.traced import TracedEngine

PARTS = ("ttft", "queue_wait", "own", "load", "prefill_ahead", "decode", "overhead", "other")
QUEUE_PARTS = ("residual", "overhead", "decode", "prefill_ahead")
EXPLAIN_LIMIT = 500
CALIBRATION_STEPS = 5  # as the quick matrix: --limit 400 explains one of its cells
PROFILE_REQUESTS = 48


def _add(p: dict[str, float], st: Any, j: int, over: float, chunk_s: Any) -> None:
    p["steps"] += j
    p["overhead"] += j * over
    p["decode"] += j * (st.per_step_s - over)
    for computed, size in st.chunks:
        p["prefill_ahead"] += chunk_s(computed, computed + j * size)


def predicted_parts(
    fut: Future,
    prompt_tokens: int,
    cached_tokens: int,
    now_s: float,
    output_tokens: int = 1,
    pinned_tokens: int = -1,
) -> dict:
    """:meth:`Future.first_token`'s walk, split into its parts (module doc)."""
    settings, cost = fut.settings, fut.cost
    first, prompt = prefill_span(prompt_tokens, cached_tokens)
    chunked = settings.chunked_prefill
    cap = settings.long_prefill_token_threshold if chunked else 0
    budget, max_seqs, over = (
        settings.max_num_batched_tokens,
        settings.max_num_seqs,
        cost.step_overhead_s,
    )
    p = dict(residual=max(fut.ready_s, now_s) - now_s, overhead=0.0, decode=0.0,
             prefill_ahead=0.0, steps=0.0)  # fmt: skip
    computed, admitted, done = first, False, False
    kv = fut.kv  # the KV model: a head whose blocks do not fit waits (Future.first_token)
    pinned = pinned_prefix(first, pinned_tokens)
    blocks = kv.blocks(prompt, pinned, output_tokens) if kv is not None else 0
    kv_cap = kv.gpu_blocks if kv is not None else 0
    for st in fut.stretches:
        left = st.budget_left
        blocked = st.running >= max_seqs or st.waiting or st.kv_used + blocks > kv_cap > 0
        if left <= 0 or (not admitted and blocked):
            _add(p, st, st.steps, over, cost.chunk_s)
            continue
        if not chunked:
            if prompt - computed > left and (prompt - computed <= budget or st.chunks):
                _add(p, st, st.steps, over, cost.chunk_s)
                continue
            _add(p, st, 1, over, cost.chunk_s)
            done = True
            break
        admitted = True
        per = cap if 0 < cap < left else left
        need = -(-(prompt - computed) // per)
        _add(p, st, min(need, st.steps), over, cost.chunk_s)
        if need <= st.steps:
            done = True
            break
        computed += st.steps * per
    if not done:  # alone on the engine after the queue
        per = prompt - computed if not chunked else min(cap or budget, budget)
        need = -(-(prompt - computed) // per)
        p["steps"] += need
        p["overhead"] += need * over
    new = NewRequest(prompt_tokens, cached_tokens, output_tokens, pinned_tokens)
    total = fut.first_token(new, now_s).ttft_s
    p["own_walk"] = cost.chunk_s(first, prompt)
    p["walk_rest"] = total - p["own_walk"] - sum(p[k] for k in QUEUE_PARTS)
    return p


class Decomposer:
    """Wraps the policy's per-candidate prediction so that, while ``current`` is set,
    each candidate's prediction is also split into parts (before the route enqueues it)."""

    def __init__(self, policy: PredictorPolicy) -> None:
        self.current: RequestId | None = None
        self.parts: dict[RequestId, dict[WorkerId, dict[str, float]]] = {}
        preds = policy.core.service.predictions
        original = preds._one

        def one(profile, hit, n, now_s, out, chain, held=0):
            cand = original(profile, hit, n, now_s, out, chain, held)
            if self.current is not None:
                wid = profile.worker_id
                cost = step_cost(preds.fits, wid, native=False)
                fut = preds.book.queues[wid]._estimate.future(now_s, cost)
                # the Python walk: its parts are what this view splits (the native walk
                # gives the same total, bit for bit: tests/unit/core/queue/test_native_walk.py)
                assert isinstance(fut, Future)
                parts = predicted_parts(fut, n, cand.cached_tokens, now_s, out,
                                        cand.pinned_tokens)  # fmt: skip
                pred = cand.prediction
                parts["own"] = preds.fits.curve(wid).own_prefill_s(n, cand.cached_tokens)
                # the later prompts' share of its steps goes with the wait (the engine's
                # trace counts their chunks in the steps the request waited through)
                parts["load"] = pred.prefill_s - parts["own"] - cand.later_s
                parts["ttft"] = pred.predicted_ttft_s
                self.parts.setdefault(self.current, {})[wid] = parts
            return cand

        preds._one = one  # type: ignore[method-assign]


class _Explained(PredictorPolicy):
    """The predictor with a :class:`Decomposer` around each decision."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.decomposer = Decomposer(self)
        self.chosen: dict[RequestId, dict[str, float]] = {}

    def decide(self, request, fleet):
        self.decomposer.current = request.request_id
        decision = super().decide(request, fleet)
        self.decomposer.current = None
        mine = self.decomposer.parts.pop(request.request_id, {})
        if decision.worker_id in mine:
            self.chosen[request.request_id] = mine[decision.worker_id]
        return decision


def _sides(pred: dict[str, float], true: dict[str, float]) -> dict[str, float]:
    """The common parts of both sides (module doc), ``pred_*`` and ``true_*``."""
    p = {"ttft": pred["ttft"], "own": pred["own"], "load": pred["load"],
         "prefill_ahead": pred["prefill_ahead"], "decode": pred["decode"],
         "overhead": pred["overhead"]}  # fmt: skip
    p["queue_wait"] = p["ttft"] - p["own"] - p["load"]
    p["other"] = p["queue_wait"] - p["prefill_ahead"] - p["decode"] - p["overhead"]
    t = {k: true[k] for k in ("ttft", "own", "load", "prefill_ahead", "decode", "overhead")}
    t["queue_wait"] = t["ttft"] - t["own"] - t["load"]
    t["other"] = true["residual"] + true["stall"] + true["idle"]
    out = {f"pred_{k}": p[k] for k in PARTS} | {f"true_{k}": t[k] for k in PARTS}
    out |= {"pred_residual": pred["residual"], "pred_walk_rest": pred["walk_rest"]}
    return out | {f"true_{k}": true[k] for k in ("residual", "stall", "idle")}


def explain_load(args: tuple[Any, float]) -> dict[str, Any]:
    """One load's replay, its per-request records."""
    prep, load = args
    started = time.perf_counter()
    requests, fleet, speedup = cell_inputs(prep, load)
    policy = _Explained.for_fleet(fleet, seed=SEED, settings=load_settings())
    engines: dict[WorkerId, Any] = {}
    result = replay(requests, fleet, policy, speedup=speedup, progress=False,
                    engine_factory=TracedEngine, engines_out=engines)  # fmt: skip
    records = []
    for r in result.records:
        pred = policy.chosen.get(r.request_id)
        if r.status != "served" or r.worker_id is None or pred is None:
            continue
        row: dict[str, Any] = {"request_id": r.request_id, "worker_id": r.worker_id,
                               "load": load, "arrival_s": round(r.ts - EPOCH_BASE_TS, 4),
                               "prompt_tokens": r.prompt_tokens,
                               "credited_cached_tokens": r.credited_cached_tokens,
                               "engine_cached_tokens": r.engine_cached_tokens,
                               "steps_predicted": pred["steps"],
                               "predicted_ttft_s": r.predicted_ttft_s,
                               "actual_ttft_s": r.actual_ttft_s}  # fmt: skip
        row |= _sides(pred, engines[r.worker_id].truth_parts(r.request_id))
        records.append(row)
    return {"load": load, "speedup": round(speedup, 4), "records": records,
            "wall_s": round(time.perf_counter() - started, 1)}  # fmt: skip


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per part: mean predicted, mean true, mean and median signed error, p95 |error|."""
    out: dict[str, dict[str, float]] = {}
    for part in PARTS:
        pred = np.array([r[f"pred_{part}"] for r in records], dtype=float)
        true = np.array([r[f"true_{part}"] for r in records], dtype=float)
        if not len(pred):
            continue
        err = pred - true
        out[part] = {"pred_mean_s": round(float(pred.mean()), 4),
                     "true_mean_s": round(float(true.mean()), 4),
                     "error_mean_s": round(float(err.mean()), 4),
                     "error_p50_s": round(float(np.median(err)), 4),
                     "abs_error_p95_s": round(float(np.percentile(abs(err), 95)), 4)}  # fmt: skip
    return out


def explain_command(trace: str, fleet: str, loads: Sequence[float], *, limit: int | None,
                    seed: int, jobs: int, max_tokens: str = "exact") -> dict[str, Any]:  # fmt: skip
    started = time.perf_counter()
    prep = prepare(trace, fleet, limit or EXPLAIN_LIMIT, seed, calibration_steps=CALIBRATION_STEPS,
                   profile_requests=PROFILE_REQUESTS, max_tokens=max_tokens)  # fmt: skip
    work = [(prep, load) for load in loads]
    if jobs > 1 and len(work) > 1:
        # spawned, not forked: `prepare` read the trace with polars here, and a child forked
        # from a process whose polars thread pool has run hangs in its first polars call
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(jobs, len(work)), mp_context=spawn) as pool:
            runs = list(pool.map(explain_load, work))
    else:
        runs = [explain_load(w) for w in work]
    records = [row for run in runs for row in run["records"]]
    summary = {f"{run['load']:g}": summarize(run["records"]) for run in runs}
    return {
        "schema": "foretoken.bench.predict-explain/1", "trace": trace, "fleet": fleet,
        "calibration": prep.calibration, "refused": prep.refused,
        "runs": [{k: v for k, v in run.items() if k != "records"} for run in runs],
        "summary": summary, "records": records,
        "wall_s": round(time.perf_counter() - started, 1),
    }  # fmt: skip


def explain_table(result: dict[str, Any]) -> str:
    head = ["load", "part", "predicted mean s", "true mean s", "error mean s", "error p50 s",
            "|error| p95 s"]  # fmt: skip
    lines = [f"{result['trace']} on {result['fleet']} (calibration {result['calibration']:.3f})",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]  # fmt: skip
    for load, parts in result["summary"].items():
        for part, s in parts.items():
            lines.append(f"| {load} | {part} | {s['pred_mean_s']:.3f} | {s['true_mean_s']:.3f} | "
                         f"{s['error_mean_s']:+.3f} | {s['error_p50_s']:+.3f} | "
                         f"{s['abs_error_p95_s']:.3f} |")  # fmt: skip
    return "\n".join(lines)
