"""Measuring llama.cpp engines behind the router (``foretoken bench real-engine`` and
``make demo ENGINES=llama``): the engines' own cold curves, the predictor learning them
through the router, prefix reuse, and a mixed stream with queueing graded from the
``graded`` topic (see :mod:`foretoken.bench.real_engine_bench` for the phases)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import random
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Any

from foretoken.ops.llama_stack import (
    LlamaStack,
    Timed,
    fit_quadratic,
    random_text,
    stream_completion,
)
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
