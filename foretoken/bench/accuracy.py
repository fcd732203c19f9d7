"""One cell of the accuracy matrix (issue 15): a (trace, fleet, load) replayed once, every
policy graded on the same requests in the same run.

A **trace** is a shipped one (``mooncake``, ``azure-code``, ``azure-conv``), a generated
workload (:data:`foretoken.sim.generate.WORKLOADS`, seeded) or a Mooncake JSONL / Azure
CSV file; a **fleet** is a shipped one (``hetero``, ``small``, ``demo``), ``random-SEED``
(:func:`foretoken.sim.generate.random_fleet`) or a fleet file. A request that some engine
of the fleet could never hold (prompt + output over its GPU blocks) is *refused* before
the replay and counted in the cell's ``refused`` (e.g. the 200k prompts of
``mix-1k-200k`` on ``small``); generated workloads are scaled to the fleet first
(:func:`foretoken.sim.generate.workload_scale`).

**Load** is relative to a calibrated capacity per (trace, fleet), as
:mod:`foretoken.bench.predict_bench` calibrates: the knee of least-outstanding-tokens
(TTFT p95 = 10 s), by bisection, as a fraction of the no-reuse capacity estimate (searched
in ``CALIBRATION_RANGE``, then geometrically below it if no probe of the range held —
decode-bound workloads; ``calibration_capped`` in the run's JSON says it hit the top). A
generated fleet's schedule change is placed at the middle of each cell's run.

In every cell, one replay: the live predictor from a cold start routes (``predictor``);
in the same run, on the same admitted requests and chosen workers, a read replica whose
fits start from an offline profile (``predictor_profiled``) and the baselines of
:mod:`foretoken.bench.baselines` (``mooncake``, ``linear_rate``, ``request_count``)
predict. The offline profile is a separate round-robin replay of cold prompts with the
workload's lengths (another seed for a generated one, the trace's last requests for a
shipped one, the requests after the cell's for a file — read no further: a week-long
public trace is not loaded whole for a 50-request cell), one at a time per worker.

With ``routing`` set to a baseline routing policy (:func:`foretoken.sim.policy.make_policy`,
e.g. ``least-outstanding-tokens`` or ``cache-aware``), that policy routes instead, and the
cold-start predictor is a read replica that predicts for the worker it chose
(``predictor``; no ``predictor_profiled`` row). The routing then does not depend on the
predictor's code: two versions of the predictor are graded on the same requests sent to
the same workers, a paired comparison without the feedback through routing that moves a
routed cell by several points for a small change of a prediction.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from foretoken.bench.baselines import SEED, ShadowBaselines, profile_replay, warm_started_replica
from foretoken.bench.predict_bench import BASELINES, PROFILED, accuracy
from foretoken.core.types import RequestId
from foretoken.settings import load_settings
from foretoken.sim.clients import MaxTokensModel
from foretoken.sim.generate import WORKLOADS, random_fleet, workload_scale
from foretoken.sim.policy import FleetLedger, make_policy
from foretoken.sim.predictor_policy import PredictorPolicy
from foretoken.sim.replay import TRACE_LOADERS, capacity_speedup, replay, summary
from foretoken.sim.spec import FleetSpec, load_fleet
from foretoken.sim.traces import TraceRequest, load_azure, load_mooncake

SCHEMA = "foretoken.bench.predict/1"
POLICIES = ("predictor", PROFILED, *BASELINES)
CELL_FIELDS = ("within_1s", "within_10s", "abs_error_p50_s", "abs_error_p95_s",
               "abs_error_p99_s")  # fmt: skip
UNDER_BOUNDS = ("5", "10", "30")
# Wider than predict_bench's (0.2, 1.0): a short cell (a few hundred requests) has its knee
# above the no-reuse estimate, and a capped calibration would make 1.3x an underload.
CALIBRATION_RANGE = (0.15, 2.0)
CALIBRATION_P95_S = 10.0
# Every probe overloaded (decode, not prefill, bounds the fleet: the estimate counts only
# prefill): bisect again, geometrically, down to this fraction of the range's bottom.
CALIBRATION_FLOOR_FACTOR = 0.02
PROFILE_PER_WORKER_GAP_S = 20.0  # each worker gets one cold profile prompt this often
PROFILE_MAX_OUTPUT = 16
PROFILE_KEY_BASE = 1 << 50
PROFILE_SEED_OFFSET = 7919
GENERATED_EXTRA = 1.2  # draw this many more generated requests (some are refused)
CHANGE_AT_FRACTION = 0.5  # a generated fleet's version change: this far into the run


# ---------------------------------------------------------------------------- inputs


def get_fleet(name: str, change_at_s: float | None = None) -> FleetSpec:
    """A shipped fleet, ``random-SEED`` or a fleet file (module doc); ``change_at_s``
    moves every schedule change of a generated fleet there."""
    if name.startswith("random-") and name.split("-", 1)[1].isdigit():
        seed = int(name.split("-", 1)[1])
        return (
            random_fleet(seed)
            if change_at_s is None
            else random_fleet(seed, change_at_s=change_at_s)
        )
    return load_fleet(name)


def without_schedule(fleet: FleetSpec) -> FleetSpec:
    return msgspec.structs.replace(fleet, schedule=())


def fits_everywhere(request: TraceRequest, fleet: FleetSpec) -> bool:
    """Whether every engine of ``fleet`` can hold ``request`` (prompt + output blocks)."""
    tokens = request.prompt_tokens + request.output_tokens - 1
    return all(-(-tokens // e.block_size) <= e.kv.gpu_blocks for e in fleet.engines)


def _raw_workload(name: str, n: int | None, fleet: FleetSpec, seed: int) -> list[TraceRequest]:
    if name in WORKLOADS:
        count = int((n or 1000) * GENERATED_EXTRA) + 16
        return WORKLOADS[name](count, seed, workload_scale(fleet))
    if name in TRACE_LOADERS:
        return TRACE_LOADERS[name](limit=n)
    path = Path(name)
    if path.suffix.lower() in (".jsonl", ".json"):
        return load_mooncake(path, limit=n)
    if path.suffix.lower() == ".csv":
        return load_azure(path, limit=n)
    known = ", ".join([*TRACE_LOADERS, *WORKLOADS])
    raise ValueError(f"unknown trace {name!r}: one of {known}, or a .jsonl / .csv file")


def load_workload(name: str, n: int | None, fleet: FleetSpec, seed: int = 0,
                  max_tokens: str = "exact") -> tuple[list[TraceRequest], int]:  # fmt: skip
    """(the first ``n`` requests some engine can hold — all of them for a trace —,
    how many of the considered ones were refused), their clients' ``max_tokens`` set by
    the model named ``max_tokens`` (:class:`foretoken.sim.clients.MaxTokensModel`)."""
    rows = MaxTokensModel.parse(max_tokens).apply(_raw_workload(name, n, fleet, seed), seed)
    if name in WORKLOADS and n is not None:
        kept = [r for r in rows if fits_everywhere(r, fleet)][:n]
        considered = next((i + 1 for i, r in enumerate(rows) if r is kept[-1]), 0) if kept else 0
        return kept, considered - len(kept)
    kept = [r for r in rows if fits_everywhere(r, fleet)]
    return kept, len(rows) - len(kept)


# ---------------------------------------------------------------------------- calibration


def calibrate(trace: list[TraceRequest], fleet: FleetSpec, steps: int) -> dict[str, Any]:
    """The calibrated capacity (module doc) as a fraction of the no-reuse estimate."""
    fleet = without_schedule(fleet)
    base = capacity_speedup(trace, fleet, reuse_prefixes=False)
    low, high = CALIBRATION_RANGE
    probes = []
    for _ in range(steps):
        mid = (low + high) / 2
        policy = make_policy("least-outstanding-tokens", FleetLedger.for_fleet(fleet), seed=SEED)
        result = replay(trace, fleet, policy, speedup=mid * base, progress=False)
        p95 = summary(result.records)["ttft_p95_s"]
        probes.append({"fraction": round(mid, 4), "ttft_p95_s": p95})
        low, high = (mid, high) if p95 is not None and p95 <= CALIBRATION_P95_S else (low, mid)
    if low == CALIBRATION_RANGE[0]:  # no probe kept its p95: below the range
        low, high = low * CALIBRATION_FLOOR_FACTOR, low
        for _ in range(steps):
            mid = math.sqrt(low * high)
            policy = make_policy(
                "least-outstanding-tokens", FleetLedger.for_fleet(fleet), seed=SEED
            )
            p95 = summary(replay(trace, fleet, policy, speedup=mid * base,
                                 progress=False).records)["ttft_p95_s"]  # fmt: skip
            probes.append({"fraction": round(mid, 5), "ttft_p95_s": p95})
            ok = p95 is not None and p95 <= CALIBRATION_P95_S
            low, high = (mid, high) if ok else (low, mid)
    return {"fraction_of_no_reuse": low, "probes": probes}


def profile_lengths(name: str, n: int, fleet: FleetSpec, seed: int,
                    limit: int | None = None) -> list[int]:  # fmt: skip
    """Prompt lengths for the offline profile (module doc); ``limit``: the cells' requests
    (a file is read up to ``limit + n`` requests)."""
    if name in WORKLOADS:
        rows = WORKLOADS[name](int(n * GENERATED_EXTRA) + 16, seed + PROFILE_SEED_OFFSET,
                               workload_scale(fleet))  # fmt: skip
        return [r.prompt_tokens for r in rows if fits_everywhere(r, fleet)][:n]
    upto = None if name in TRACE_LOADERS or limit is None else limit + n
    rows = [r for r in _raw_workload(name, upto, fleet, seed) if fits_everywhere(r, fleet)]
    return [r.prompt_tokens for r in rows[-n:]]


def profile(lengths: list[int], fleet: FleetSpec) -> dict[str, Any]:
    """The baselines' offline fits and the replica's cold samples (module doc)."""
    fleet = without_schedule(fleet)
    gap_s = PROFILE_PER_WORKER_GAP_S / len(fleet.engines)
    requests = [
        TraceRequest(request_id=RequestId(f"profile-{i:05d}"), arrival_s=gap_s * i,
                     prompt_tokens=n, output_tokens=PROFILE_MAX_OUTPUT,
                     segment_keys=(PROFILE_KEY_BASE + i,), segment_lengths=(n,))
        for i, n in enumerate(lengths)
    ]  # fmt: skip
    return profile_replay(requests, fleet)


@dataclass(frozen=True, slots=True)
class Prepared:
    """What the cells of one (trace, fleet) share: calibration and offline profile."""

    trace: str
    fleet: str
    limit: int | None
    seed: int
    calibration: float
    fits: dict[str, Any] = field(default_factory=dict)
    warm: bytes = b""  # the profile follower's fit snapshot (warm_started_replica)
    refused: int = 0
    requests: int = 0
    wall_s: float = 0.0
    max_tokens: str = "exact"  # what the clients send (MaxTokensModel)


def prepare(trace: str, fleet: str, limit: int | None, seed: int, *, calibration_steps: int,
            profile_requests: int, max_tokens: str = "exact") -> Prepared:  # fmt: skip
    started = time.perf_counter()
    spec = get_fleet(fleet)
    requests, refused = load_workload(trace, limit, spec, seed, max_tokens)
    cal = calibrate(requests, spec, calibration_steps)
    prof = profile(profile_lengths(trace, profile_requests, spec, seed, limit), spec)
    return Prepared(trace, fleet, limit, seed, cal["fraction_of_no_reuse"], prof["fits"],
                    prof["replica_fits"], refused, len(requests),
                    round(time.perf_counter() - started, 1), max_tokens)  # fmt: skip


# ---------------------------------------------------------------------------- a cell


def cell_speedup(
    prep: Prepared, requests: list[TraceRequest], fleet: FleetSpec, load: float
) -> float:
    return load * prep.calibration * capacity_speedup(requests, without_schedule(fleet),
                                                      reuse_prefixes=False)  # fmt: skip


def cell_inputs(prep: Prepared, load: float) -> tuple[list[TraceRequest], FleetSpec, float]:
    """The cell's requests, fleet (its schedule change mid-run) and speedup."""
    fleet = get_fleet(prep.fleet)
    requests, _ = load_workload(prep.trace, prep.limit, fleet, prep.seed, prep.max_tokens)
    speedup = cell_speedup(prep, requests, fleet, load)
    if fleet.schedule and prep.fleet.startswith("random-"):
        span_s = (requests[-1].arrival_s - requests[0].arrival_s) / speedup
        fleet = get_fleet(prep.fleet, change_at_s=CHANGE_AT_FRACTION * span_s)
    return requests, fleet, speedup


def cell_rows(prep: Prepared, load: float, graded: dict[str, Any],
              routing: str = "predictor") -> list[dict[str, Any]]:  # fmt: skip
    """One row per policy, in the stable schema (:data:`SCHEMA`); ``routing``: which policy
    routed the cell (module doc)."""
    rows = []
    for policy in POLICIES:
        g = graded.get(policy)
        if g is None:
            continue
        sides = g["same_side_of_bound"]
        row: dict[str, Any] = {"trace": prep.trace, "fleet": prep.fleet, "load": load,
                               "policy": policy, "routing": routing}  # fmt: skip
        row |= {name: g[name] for name in CELL_FIELDS}
        row |= {f"under_{b}s": sides[b]["underpredicted"] for b in UNDER_BOUNDS}
        row["p90_coverage"] = g.get("p90_coverage")  # the predictor's calibration
        row |= {"disagreement": graded["cache_disagreement_rate"], "samples": g["served"],
                "refused": prep.refused, "rejected": graded["rejected"]}  # fmt: skip
        rows.append(row)
    return rows


def run_cell(prep: Prepared, load: float, routing: str | None = None) -> dict[str, Any]:
    """Replay one cell (module doc), routed by the predictor or by ``routing``; its rows
    and what it cost."""
    started = time.perf_counter()
    requests, fleet, speedup = cell_inputs(prep, load)
    if routing is None:
        policy = PredictorPolicy.for_fleet(fleet, seed=SEED, settings=load_settings())
        replica = warm_started_replica(without_schedule(fleet), prep.warm)
        shadow = ShadowBaselines(policy, prep.fits, replica)
    else:  # the cold predictor as a read replica of a baseline's routing
        inner = make_policy(routing, FleetLedger.for_fleet(fleet), seed=SEED)
        replica = warm_started_replica(without_schedule(fleet), None)
        shadow = ShadowBaselines(inner, prep.fits, replica)
    result = replay(requests, fleet, shadow, speedup=speedup, progress=False)
    graded = accuracy(result.records, shadow, replica_routed=routing is not None)
    return {
        "rows": cell_rows(prep, load, graded, routing or "predictor"),
        "meta": {"trace": prep.trace, "fleet": prep.fleet, "load": load,
                 "routing": routing or "predictor",
                 "speedup": round(speedup, 4), "requests": len(requests),
                 "virtual_s": round(result.virtual_s, 1),
                 "wall_s": round(time.perf_counter() - started, 1)},
    }  # fmt: skip
