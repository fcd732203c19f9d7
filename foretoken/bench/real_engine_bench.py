"""A real engine in the loop: ``foretoken bench real-engine`` (issue #9).

``python -m foretoken.bench.real_engine_bench [--quick] [--engines N]`` prints one JSON object. It
starts, as real processes on a topic prefix of its own, llama.cpp servers
(llama-cpp-python built from PyPI, serving the generated tiny GGUF of
``fleet/gguf_model.py``), the Faust worker (route service), ``ingest`` (registration only:
llama.cpp publishes no KV events) and the router (``ops/llama_stack.py``). Phases:

1. ``engine_curve`` — the baseline, measured in the same run: cold prompts of 512..16k
   tokens sent straight to each engine, one at a time; TTFT per size (median of the
   repeats) and the least-squares ``a·N + b·N²`` through them.
2. ``learn`` — cold prompts of the same sizes through the router, one at a time (each alone
   on its worker), until the predictor's fit for every worker leaves the default.
3. ``curve`` — the fitted curve (``GET /v1/fits``) against the measured one, per size:
   ratio fitted / measured. No number from the engine's configuration reaches the
   predictor: it learns only from the TTFTs the router measures.
4. ``prefix_reuse`` — a long prompt, then the same prompt plus a short suffix on the same
   conversation: the engine reuses the prefix (llama-cpp-python keeps its last prompt's
   KV); actual TTFT of both, and what the predictor said.
5. ``mixed`` — a stream with queueing: Poisson arrivals at a target utilization, cold
   prompts of mixed lengths and conversation follow-ups (a turn's prompt plus 256 tokens,
   sent at least ``THINK_S`` after that turn's answer), several in flight per engine (the
   engine serves them one at a time). Predicted vs actual TTFT from the ``graded``
   topic: the share within max(10 %, 0.2 s) (the issue's bar: >= 90 %), by kind.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foretoken.adapters.kafka.graded_reader import read_graded
from foretoken.adapters.kafka.topics import ensure_topics
from foretoken.ops import kafka_local
from foretoken.ops.llama_stack import (
    LlamaStack,
    Timed,
    fit_quadratic,
    random_text,
    start_llama_stack,
    stream_completion,
)
from foretoken.settings import load_settings
from foretoken.sim.live.llama_server import LlamaServerConfig
from foretoken.wire.records import Graded

TOLERANCE_REL = 0.10
TOLERANCE_ABS_S = 0.2
TARGET_SHARE = 0.90
SUFFIX_TOKENS = 256
# Between dependent requests (a conversation's turns, the learning sweep): the router's
# outcomes reach the route service through Kafka, tens to hundreds of ms later under load.
THINK_S = 1.0
OUTPUT_TOKENS = 8


@dataclass(frozen=True)
class Mode:
    sizes: tuple[int, ...]
    repeats: int
    learn_rounds: int
    mixed_requests: int
    mixed_sizes: tuple[int, ...]
    utilization: float
    follow_up_share: float
    n_ctx: int


FULL = Mode(sizes=(512, 1024, 2048, 4096, 6144, 8192, 12288, 16384), repeats=3, learn_rounds=3,
            mixed_requests=80, mixed_sizes=(512, 1024, 2048, 3072, 4096, 6144),
            utilization=0.5, follow_up_share=0.3, n_ctx=17408)  # fmt: skip
QUICK = Mode(sizes=(512, 1024, 2048, 4096, 6144), repeats=2, learn_rounds=3,
             mixed_requests=24, mixed_sizes=(512, 1024, 2048, 3072),
             utilization=0.5, follow_up_share=0.3, n_ctx=8704)  # fmt: skip


def within(predicted: float, actual: float) -> bool:
    return abs(predicted - actual) <= max(TOLERANCE_REL * actual, TOLERANCE_ABS_S)


def curve_at(a: float, b: float, n: int) -> float:
    return a * n + b * n * n


# ---------------------------------------------------------------------- phases


def engine_curve(stack: LlamaStack, mode: Mode, rng: random.Random) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for llama in stack.llamas:
        stream_completion(llama.url, stack.model, random_text(rng, 64))  # warm-up
        per_size: dict[int, float] = {}
        repeatable: list[bool] = []
        for n in mode.sizes:
            times = []
            for _ in range(mode.repeats):
                timed = stream_completion(llama.url, stack.model, random_text(rng, n))
                assert timed.ttft_s is not None, "the engine streamed no text"
                times.append(timed.ttft_s)
            per_size[n] = statistics.median(times)
            repeatable += [within(per_size[n], t) for t in times]
        a, b = fit_quadratic(list(per_size.items()))
        out[llama.worker_id] = {
            "ttft_s": {str(n): round(t, 4) for n, t in per_size.items()},
            # The engine's own repeatability: the share of repeats within the bar of their
            # size's median (a predictor that knew each median exactly would score this).
            "repeats_within_bar_of_median": round(sum(repeatable) / len(repeatable), 3),
            "a": a, "b": b,
            "quadratic_share_at_max": round(
                b * max(mode.sizes) ** 2 / curve_at(a, b, max(mode.sizes)), 3),
        }  # fmt: skip
    return out


def learn(stack: LlamaStack, mode: Mode, rng: random.Random) -> dict[str, Any]:
    started = time.monotonic()
    sent = 0
    for _round in range(mode.learn_rounds):
        for n in rng.sample(list(mode.sizes), len(mode.sizes)):
            for _ in stack.llamas:  # one at a time: each request is alone on its worker
                stream_completion(stack.router_url, stack.model, random_text(rng, n))
                sent += 1
                time.sleep(THINK_S)  # its outcomes reach the route service before the next
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if not any(f["default"] for f in stack.fits().values()):
                return {"requests": sent, "wall_s": round(time.monotonic() - started, 1),
                        "learned": True}  # fmt: skip
            time.sleep(1.0)
    return {"requests": sent, "wall_s": round(time.monotonic() - started, 1), "learned": False}


def compare_curves(stack: LlamaStack, measured: dict[str, Any], mode: Mode) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for wid, fit in stack.fits().items():
        m = measured[wid]
        rows = []
        for n in mode.sizes:
            fitted = curve_at(float(fit["a"]), float(fit["b"]), n)  # type: ignore[arg-type]
            engine = float(m["ttft_s"][str(n)])
            rows.append({"n": n, "fitted_s": round(fitted, 4), "measured_s": round(engine, 4),
                         "ratio": round(fitted / engine, 3)})  # fmt: skip
        out[wid] = {"fit": {k: fit[k] for k in ("a", "b", "samples", "default")},
                    "measured": {"a": m["a"], "b": m["b"]}, "by_size": rows}  # fmt: skip
    return out


def prefix_reuse(stack: LlamaStack, mode: Mode, rng: random.Random) -> dict[str, Any]:
    n = max(s for s in mode.sizes if s <= mode.n_ctx - 2 * SUFFIX_TOKENS - 64)
    base = random_text(rng, n)
    conv = f"bench-{uuid.uuid4().hex[:6]}"
    rows = []
    prompt = base
    for step in range(3):
        rid = f"reuse-{conv}-{step}"
        headers = {"x-request-id": rid, "x-conversation-id": conv}
        timed = stream_completion(stack.router_url, stack.model, prompt, headers=headers)
        rows.append({"request_id": rid, "prompt_tokens": len(prompt),
                     "client_ttft_s": round(timed.ttft_s or -1, 4)})  # fmt: skip
        prompt += random_text(rng, SUFFIX_TOKENS)
        time.sleep(THINK_S)  # a user reads the answer; the outcome reaches the route service
    return {"rows": rows}


async def _mixed_async(stack: LlamaStack, mode: Mode, rng: random.Random,
                       mean_service_s: float) -> dict[str, Any]:  # fmt: skip
    rate = mode.utilization * len(stack.llamas) / mean_service_s
    loop = asyncio.get_running_loop()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=64)
    # Conversations whose last turn has completed (a follow-up comes after its answer).
    history: list[tuple[str, str, float]] = []  # (conversation id, prompt, completed at)
    kinds: dict[str, str] = {}
    tasks = []

    def send(conv: str, prompt: str, headers: dict[str, str]) -> Timed:
        timed = stream_completion(stack.router_url, stack.model, prompt,
                                  max_tokens=OUTPUT_TOKENS, headers=headers)  # fmt: skip
        history.append((conv, prompt, time.monotonic()))
        return timed

    started = time.monotonic()
    at = 0.0
    for i in range(mode.mixed_requests):
        at += rng.expovariate(rate)
        rid = f"mixed-{i}-{uuid.uuid4().hex[:6]}"
        delay = max(0.0, started + at - time.monotonic())
        await asyncio.sleep(delay)
        answered = [h for h in history if time.monotonic() - h[2] >= THINK_S]
        if answered and rng.random() < mode.follow_up_share:
            conv, prev, _done = answered[rng.randrange(len(answered))]
            history.remove((conv, prev, _done))
            prompt, kind = prev + random_text(rng, SUFFIX_TOKENS), "follow_up"
        else:
            conv = f"c{i}-{uuid.uuid4().hex[:6]}"
            prompt, kind = random_text(rng, rng.choice(mode.mixed_sizes)), "cold"
        kinds[rid] = kind
        headers = {"x-request-id": rid, "x-conversation-id": conv}
        tasks.append(loop.run_in_executor(pool, functools.partial(send, conv, prompt, headers)))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    pool.shutdown()
    failed = sum(isinstance(r, BaseException) for r in results)
    return {"rate_rps": round(rate, 3), "kinds": kinds, "failed": failed,
            "wall_s": round(time.monotonic() - started, 1)}  # fmt: skip


def grade_mixed(graded: list[Graded], kinds: dict[str, str]) -> dict[str, Any]:
    by_kind: dict[str, list[Graded]] = {}
    unpredicted = 0
    for g in graded:
        kind = kinds.get(g.request_id)
        if kind is None or g.status != "served":
            continue
        if g.fallback:  # the route service did not answer in time: the router chose alone
            unpredicted += 1
        if g.predicted_ttft_s is None or g.actual_ttft_s is None:
            continue
        by_kind.setdefault(kind, []).append(g)
        by_kind.setdefault("all", []).append(g)
    out: dict[str, Any] = {"fallback_unpredicted": unpredicted}
    served = sorted(by_kind.get("all", []), key=lambda g: g.ts)
    out["over_predicted"] = sum((g.predicted_ttft_s or 0) > (g.actual_ttft_s or 0) for g in served)
    out["rows"] = [
        [kinds[g.request_id], g.worker_id, g.prompt_tokens, g.credited_cached_tokens,
         g.queue_tokens_ahead, round(g.predicted_ttft_s or 0, 3), round(g.actual_ttft_s or 0, 3)]
        for g in served
    ]  # fmt: skip
    out["row_columns"] = ["kind", "worker", "prompt", "credited", "ahead", "predicted_s",
                          "actual_s"]  # fmt: skip
    for kind, rows in by_kind.items():
        pairs = [(g.predicted_ttft_s or 0.0, g.actual_ttft_s or 0.0) for g in rows]
        ok = [within(p, a) for p, a in pairs]
        errs = sorted(abs(p - a) for p, a in pairs)
        out[kind] = {
            "served": len(rows),
            "share_within": round(sum(ok) / len(ok), 3),
            "abs_error_p50_s": round(errs[len(errs) // 2], 3),
            "abs_error_p90_s": round(errs[int(0.9 * (len(errs) - 1))], 3),
            "actual_ttft_p50_s": round(statistics.median(a for _, a in pairs), 3),
            "queued_share": round(sum(g.queue_tokens_ahead > 0 for g in rows) / len(rows), 3),
        }
    return out


# ---------------------------------------------------------------------- driver


def run(quick: bool, engines: int | None = None) -> dict[str, Any]:
    mode = QUICK if quick else FULL
    count = engines or (1 if quick else 2)
    base = load_settings()
    started_broker = False
    if not kafka_local.accepts_connections(base.kafka.bootstrap_servers):
        _status, started_broker = kafka_local.up(base)
    prefix = f"re{uuid.uuid4().hex[:8]}-"
    env = {"FORETOKEN_TOPIC_PREFIX": prefix, "FORETOKEN_LOG_LEVEL": "warn",
           "KAFKA_BOOTSTRAP_SERVERS": base.kafka.bootstrap_servers}  # fmt: skip
    settings = load_settings(env={**os.environ, **env})
    asyncio.run(ensure_topics(settings))
    tmp = Path(tempfile.mkdtemp(prefix="real-engine-bench-"))
    rng = random.Random(9)
    load_start = os.getloadavg()
    stack: LlamaStack | None = None
    try:
        stack = start_llama_stack(env, tmp, count=count, cfg=LlamaServerConfig(n_ctx=mode.n_ctx))
        measured = engine_curve(stack, mode, rng)
        learned = learn(stack, mode, rng)
        curves = compare_curves(stack, measured, mode)
        reuse = prefix_reuse(stack, mode, rng)
        sizes = mode.mixed_sizes
        mean_prefill = statistics.mean(
            statistics.mean(curve_at(m["a"], m["b"], n) for n in sizes) for m in measured.values()
        )
        tpot = 0.01  # per output token on this tiny model; only sets the arrival rate
        mixed = asyncio.run(_mixed_async(stack, mode, rng, mean_prefill + OUTPUT_TOKENS * tpot))
        graded = {g.request_id: g for g in asyncio.run(read_graded(settings, 60.0, idle_s=8.0))}
        for row in reuse["rows"]:
            g = graded.get(row["request_id"])
            if g is not None:
                row |= {"predicted_ttft_s": g.predicted_ttft_s, "actual_ttft_s": g.actual_ttft_s,
                        "credited_cached_tokens": g.credited_cached_tokens,
                        "approximate_cache": g.approximate_cache}  # fmt: skip
        accuracy = grade_mixed(list(graded.values()), mixed.pop("kinds"))
        step_fits = {w: {k: f[k] for k in ("overhead_s", "per_seq_s", "step_samples",
                                           "step_default")}
                     for w, f in stack.fits().items()}  # fmt: skip
    except BaseException:
        if stack is not None:
            print(stack.logs(), file=sys.stderr)
        raise
    finally:
        if stack is not None:
            stack.stop_all()
        if started_broker:
            kafka_local.down(base)
    shutil.rmtree(tmp, ignore_errors=True)
    share = accuracy.get("all", {}).get("share_within")
    return {
        "mode": "quick" if quick else "full", "engines": count, "n_ctx": mode.n_ctx,
        "cpus": os.cpu_count(), "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "engine_curve": measured, "learn": learned, "curve": curves,
        "prefix_reuse": reuse, "mixed": {**mixed, "accuracy": accuracy},
        "step_fits_after": step_fits,
        "target": {"tolerance": f"max({TOLERANCE_REL:.0%}, {TOLERANCE_ABS_S} s)",
                   "share": TARGET_SHARE, "reached": share,
                   "met": share is not None and share >= TARGET_SHARE},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--engines", type=int, default=None, help="llama.cpp servers (1 or 2)")
    args = parser.parse_args()
    print(json.dumps(run(args.quick, args.engines), indent=2))


if __name__ == "__main__":
    main()
