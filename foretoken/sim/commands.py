"""What ``foretoken replay`` and ``foretoken load`` do, composed from the fleet modules (the
CLI only parses arguments)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import foretoken.sim.cache_aware
import foretoken.sim.predictor_policy  # noqa: F401  (registers the "predictor" policy)
from foretoken.settings import ControlSettings, Settings
from foretoken.sim.classes import ClassMix, class_summary, write_control_events
from foretoken.sim.clients import BoundMix
from foretoken.sim.live.load import run_load, write_results_parquet
from foretoken.sim.policy import make_policy
from foretoken.sim.predictor_policy import ApproxPredictorPolicy, PredictorPolicy
from foretoken.sim.replay import (
    TRACE_LOADERS,
    FleetLedger,
    capacity_speedup,
    replay,
    write_lake,
)
from foretoken.sim.spec import load_fleet
from foretoken.sim.traces import (
    TraceFormatError,
    TraceRequest,
    load_azure,
    load_mooncake,
)

TRACE_HELP = ", ".join(TRACE_LOADERS)


def load_trace(trace: str, limit: int | None, speedup: float = 1.0) -> list[TraceRequest]:
    """A shipped trace or a file's requests; a file with none is an error (a replay or a
    load of nothing used to exit 0)."""
    if trace in TRACE_LOADERS:
        return TRACE_LOADERS[trace](limit=limit, speedup=speedup)
    path = Path(trace)
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        requests = load_mooncake(path, limit=limit, speedup=speedup)
    elif suffix == ".csv":
        requests = load_azure(path, limit=limit, speedup=speedup)
    else:
        raise ValueError(f"unknown trace {trace!r}: a shipped name ({TRACE_HELP}) or a "
                         ".jsonl/.csv file")  # fmt: skip
    if not requests:
        raise TraceFormatError(f"{trace}: no request in it (empty, or every row without "
                               "output tokens)")  # fmt: skip
    return requests


def with_bounds(requests: list[TraceRequest], bounds: str | None, seed: int) -> list[TraceRequest]:
    return BoundMix.parse(bounds).assign(requests, seed=seed) if bounds else requests


def replay_command(
    *, trace: str, fleet: str, policy: str, speedup: float | None, capacity_factor: float | None,
    limit: int | None, bounds: str | None, out: str | None, seed: int, progress: bool,
    controls: str | None = None, classes: str | None = None,
    control_settings: ControlSettings | None = None, settings: Settings | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Replay a trace on a fleet in virtual time; with ``out``, append the records to the
    grading lake there. Returns the summary (also what is printed).

    ``classes`` ("interactive:0.3,batch:0.7") gives requests workload classes (and their
    classes' default bounds) from ``control_settings``; ``controls`` "on" runs the latency
    controls in virtual time (predictor policy only), "off" the same without them."""
    if speedup is not None and capacity_factor is not None:
        raise ValueError("give --speedup or --capacity-factor, not both")
    if controls not in (None, "on", "off"):
        raise ValueError(f"--controls must be on or off, got {controls!r}")
    if controls == "on" and policy != "predictor":
        raise ValueError("the latency controls act through the predictor: use --policy predictor")
    spec = load_fleet(fleet)
    base = load_trace(trace, limit)
    factor_speedup = None
    if capacity_factor is not None:
        factor_speedup = capacity_factor * capacity_speedup(base, spec)
    chosen_speedup = speedup or factor_speedup or 1.0
    requests = with_bounds(base, bounds, seed)
    processor_settings = settings
    classes_settings = control_settings or ControlSettings()
    if classes:
        requests = ClassMix.parse(classes).assign(requests, classes_settings, seed)
    controller = None
    predictors = {cls.name: cls for cls in (PredictorPolicy, ApproxPredictorPolicy)}
    if controls == "on" or policy in predictors:
        # the processor's core from the settings (index backend, predictor, fits, join)
        chosen: Any = predictors[policy].for_fleet(
            spec, seed, settings=processor_settings,
            controls=classes_settings if controls == "on" else None,
        )  # fmt: skip
        controller = chosen.core.controls
    else:
        chosen = make_policy(policy, FleetLedger.for_fleet(spec), seed=seed)
    result = replay(requests, spec, chosen, speedup=chosen_speedup, progress=progress)
    if out is not None:
        write_lake(result.records, out)
    summary = result.summary()
    summary.update({"policy": policy, "fleet": spec.name, "trace": trace,
                    "speedup": chosen_speedup, "capacity_factor": capacity_factor,
                    "controls": controls or "off"})  # fmt: skip
    if classes or controls:
        summary["classes"] = class_summary(result.records, classes_settings)
    if controller is not None:
        events = list(controller.history)
        summary["control_transitions"] = controller.transitions
        summary["control_stage_entries"] = {
            stage: sum(e.to_stage == stage for e in events)
            for stage in ("warn", "reroute", "admission")
        }
        summary["rerouted"] = chosen.counters.rerouted
        if out is not None:
            write_control_events(events, out)
    return summary


def load_command(
    *, url: str, model: str, trace: str, limit: int | None, speedup: float, bounds: str | None,
    concurrency: int, timeout_s: float, max_output_tokens: int | None, duration_s: float | None,
    out: str | None, seed: int, progress: bool,
) -> dict[str, Any]:  # fmt: skip
    """Replay a trace's arrivals against any OpenAI-compatible URL; client-side results to
    Parquet. Returns the summary counts and TTFT percentiles."""
    requests = with_bounds(load_trace(trace, limit, speedup), bounds, seed)
    summary = run_load(url, model, requests, concurrency=concurrency, timeout_s=timeout_s,
                       max_output_tokens=max_output_tokens, max_duration_s=duration_s,
                       progress=progress)  # fmt: skip
    if out is not None:
        write_results_parquet(summary.results, out)
    return summary.counts()


def dumps(summary: dict[str, Any]) -> str:
    return json.dumps(summary, indent=1, default=str)
