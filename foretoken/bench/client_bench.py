"""`foretoken bench client --url URL --model M`: P95 TTFT where users wait — in the client —
per load step, the highest step that meets a P95 target, and replica sizing (issue #8).

Every request is a streaming ``/v1/completions`` call made with the **official openai
client** (``AsyncOpenAI``, ``max_retries=0``: a 429 is counted, never retried), so the
numbers are what an application built on that client sees. TTFT is measured from just
before the call to the first chunk with non-empty text. It works against the router, a
simulated engine (``foretoken fleet run``) or any OpenAI-compatible endpoint.

**Steps.** Concurrency steps (``--concurrency 1,4,16``: a closed loop of C clients, each
sending its next request when the last one ends) and/or rate steps (``--rate 2,8``: an
open loop, arrivals with Gamma gaps of shape ``--burstiness`` — 1 Poisson, < 1 bursty —
as ``vllm bench serve`` draws them, at most ``--max-concurrency`` in flight). Each step
sends ``--requests`` requests.

**Prompts** come from a shipped trace (``azure-code``, ``azure-conv``, ``mooncake``: token
ids, with their output lengths capped by ``--max-tokens``) or a dataset file: ``.jsonl``
with a ``prompt`` / ``text`` field or ShareGPT ``conversations``, or ``.txt`` (one prompt
per line).

**Per step**: sent, ok, 429s (apart), other errors; P50/P95/P99 TTFT of the successful
requests; achieved requests per second (successes / step wall time); the most requests
seen in flight. A step **meets** the target when it has successes, its P95 TTFT ≤
``--p95-target-s`` and its 429s are at most ``--max-429-share`` of what it sent.

**Sizing** from the best (highest meeting) step: ``replicas = ceil(peak concurrency / best
concurrency)`` (``--peak-concurrency``; a rate step's concurrency is its most in flight)
and ``target_rps_per_replica`` = the best step's achieved rate; with ``--peak-rps`` also
``ceil(peak rps / target rps per replica)``. One "replica" is whatever sits behind the URL.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import openai
from rich.console import Console
from rich.table import Table

from foretoken.sim.traces import gamma_arrivals

PERCENTILES = (50.0, 95.0, 99.0)
DEFAULT_MAX_TOKENS = 16
SHIPPED_TRACES = ("azure-code", "azure-conv", "mooncake")


@dataclass(frozen=True, slots=True)
class Prompt:
    prompt: str | list[int]
    max_tokens: int


@dataclass(slots=True)
class Sample:
    ok: bool
    status: int | None  # HTTP status of a failure (429 …); None for transport errors
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None


@dataclass(slots=True)
class StepResult:
    kind: str  # "concurrency" | "rate"
    value: float
    sent: int = 0
    ok: int = 0
    rejected_429: int = 0
    errors: int = 0
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    ttft_p99_s: float | None = None
    achieved_rps: float = 0.0
    peak_in_flight: int = 0
    wall_s: float = 0.0
    meets_target: bool = False
    first_errors: list[str] = field(default_factory=list)

    @property
    def concurrency(self) -> int:
        return int(self.value) if self.kind == "concurrency" else self.peak_in_flight


# ---------------------------------------------------------------------- prompts


def load_prompts(source: str, n: int, max_tokens: int, seed: int = 0) -> list[Prompt]:
    """``n`` prompts from a shipped trace (token ids) or a dataset file, cycling if short."""
    if n < 1:
        raise ValueError("need at least one prompt")
    prompts: list[Prompt]
    if source in SHIPPED_TRACES:
        from foretoken.sim.commands import load_trace

        trace = load_trace(source, n)
        prompts = [
            Prompt([int(t) for t in r.token_ids], min(r.output_tokens, max_tokens)) for r in trace
        ]
    else:
        prompts = [Prompt(text, max_tokens) for text in _dataset_texts(Path(source))]
    if not prompts:
        raise ValueError(f"no prompts in {source}")
    order = np.random.default_rng(seed).permutation(len(prompts))
    return [prompts[int(order[i % len(prompts)])] for i in range(n)]


def _dataset_texts(path: Path) -> list[str]:
    if not path.exists():
        raise ValueError(f"no dataset file {path} (or a shipped trace: {SHIPPED_TRACES})")
    if path.suffix == ".txt":
        return [
            line.strip()
            for line in path.read_text(encoding="utf-8-sig").splitlines()
            if line.strip()
        ]
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"dataset {path}: expected .jsonl, .json or .txt")
    texts: list[str] = []
    lines = path.read_text(encoding="utf-8-sig").splitlines()
    rows: list[Any] = (
        json.loads(path.read_text(encoding="utf-8-sig"))
        if path.suffix == ".json"
        else [json.loads(line) for line in lines if line.strip()]
    )
    for number, row in enumerate(rows, 1):
        text = _row_text(row)
        if text is None:
            raise ValueError(f"dataset {path} row {number}: no prompt/text/conversations")
        texts.append(text)
    return texts


def _row_text(row: Any) -> str | None:
    if not isinstance(row, dict):
        return None
    for key in ("prompt", "text"):
        if isinstance(row.get(key), str) and row[key]:
            return str(row[key])
    turns = row.get("conversations")
    if isinstance(turns, list):  # ShareGPT: the first human turn
        for turn in turns:
            if isinstance(turn, dict) and turn.get("from") in ("human", "user"):
                return str(turn.get("value", "")) or None
    return None


# ---------------------------------------------------------------------- one request


async def _one(
    client: openai.AsyncOpenAI, model: str, prompt: Prompt, headers: dict[str, str]
) -> Sample:
    started = time.perf_counter()
    ttft = None
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt.prompt,
            max_tokens=prompt.max_tokens,
            stream=True,
            extra_headers={**headers, "x-request-id": uuid.uuid4().hex},
        )
        async for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].text:
                ttft = time.perf_counter() - started
        if ttft is None:
            return Sample(False, None, error="no content in the stream")
        return Sample(True, 200, ttft, time.perf_counter() - started)
    except openai.APIStatusError as exc:
        return Sample(False, exc.status_code, error=f"{exc.status_code}: {exc.message[:200]}")
    except openai.APIError as exc:  # connection errors, timeouts
        return Sample(False, None, error=f"{type(exc).__name__}: {exc}"[:200])


class _InFlight:
    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def __enter__(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def __exit__(self, *exc: object) -> None:
        self.now -= 1


async def _closed_loop(
    client: openai.AsyncOpenAI,
    model: str,
    prompts: Sequence[Prompt],
    concurrency: int,
    headers: dict[str, str],
    flight: _InFlight,
) -> list[Sample]:
    queue = list(reversed(prompts))
    out: list[Sample] = []

    async def user() -> None:
        while queue:
            prompt = queue.pop()
            with flight:
                out.append(await _one(client, model, prompt, headers))

    await asyncio.gather(*(user() for _ in range(concurrency)))
    return out


async def _open_loop(
    client: openai.AsyncOpenAI,
    model: str,
    prompts: Sequence[Prompt],
    rate: float,
    burstiness: float,
    max_concurrency: int,
    seed: int,
    headers: dict[str, str],
    flight: _InFlight,
) -> list[Sample]:
    arrivals = gamma_arrivals(rate, len(prompts), burstiness, seed)
    gate = asyncio.Semaphore(max_concurrency)
    start = time.perf_counter()

    async def send(at: float, prompt: Prompt) -> Sample:
        delay = at - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        async with gate:
            with flight:
                return await _one(client, model, prompt, headers)

    return list(
        await asyncio.gather(*(send(float(a), p) for a, p in zip(arrivals, prompts, strict=True)))
    )


# ---------------------------------------------------------------------- steps


def summarize(
    kind: str,
    value: float,
    samples: Sequence[Sample],
    wall_s: float,
    peak: int,
    p95_target_s: float,
    max_429_share: float,
) -> StepResult:
    ok = [s for s in samples if s.ok and s.ttft_s is not None]
    r = StepResult(
        kind=kind,
        value=value,
        sent=len(samples),
        ok=len(ok),
        rejected_429=sum(s.status == 429 for s in samples),
        wall_s=wall_s,
        peak_in_flight=peak,
    )
    r.errors = r.sent - r.ok - r.rejected_429
    if ok:
        tails = np.percentile(np.asarray([s.ttft_s for s in ok], dtype=float), PERCENTILES)
        r.ttft_p50_s, r.ttft_p95_s, r.ttft_p99_s = (float(x) for x in tails)
    r.achieved_rps = r.ok / wall_s if wall_s > 0 else 0.0
    r.meets_target = bool(
        r.ok
        and r.ttft_p95_s is not None
        and r.ttft_p95_s <= p95_target_s
        and r.rejected_429 <= max_429_share * r.sent
    )
    r.first_errors = [s.error for s in samples if s.error and s.status != 429][:3]
    return r


def sizing(
    steps: Sequence[StepResult], peak_concurrency: int | None, peak_rps: float | None
) -> dict[str, Any]:
    """Replicas from the highest step that meets the target (None when none does)."""
    meeting = [s for s in steps if s.meets_target]
    if not meeting:
        return {
            "best_step": None,
            "replicas": None,
            "target_rps_per_replica": None,
            "note": "no step met the P95 target",
        }
    best = max(meeting, key=lambda s: (s.concurrency, s.achieved_rps))
    per_replica = max(best.concurrency, 1)
    out: dict[str, Any] = {
        "best_step": {
            "kind": best.kind,
            "value": best.value,
            "concurrency": per_replica,
            "ttft_p95_s": best.ttft_p95_s,
        },
        "target_rps_per_replica": best.achieved_rps,
        "peak_concurrency": peak_concurrency,
        "replicas": math.ceil(peak_concurrency / per_replica) if peak_concurrency else None,
    }
    if peak_rps is not None and best.achieved_rps > 0:
        out["peak_rps"] = peak_rps
        out["replicas_by_rate"] = math.ceil(peak_rps / best.achieved_rps)
    return out


@dataclass(frozen=True, slots=True)
class ClientBenchConfig:
    url: str
    model: str
    concurrency: tuple[int, ...] = ()
    rates: tuple[float, ...] = ()
    burstiness: float = 1.0
    max_concurrency: int = 256
    requests: int = 50
    source: str = "azure-code"
    max_tokens: int = DEFAULT_MAX_TOKENS
    p95_target_s: float = 2.0
    max_429_share: float = 0.05
    peak_concurrency: int | None = None
    peak_rps: float | None = None
    timeout_s: float = 120.0
    workload_class: str | None = None
    max_queue_wait_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.concurrency and not self.rates:
            raise ValueError("give --concurrency steps and/or --rate steps")
        if any(c < 1 for c in self.concurrency) or any(not r > 0 for r in self.rates):
            raise ValueError("concurrency steps must be >= 1 and rates > 0")
        if self.requests < 1 or self.p95_target_s <= 0:
            raise ValueError("--requests must be >= 1 and --p95-target-s > 0")


async def run_async(cfg: ClientBenchConfig) -> dict[str, Any]:
    base = cfg.url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    headers: dict[str, str] = {}
    if cfg.workload_class:
        headers["x-workload-class"] = cfg.workload_class
    if cfg.max_queue_wait_s is not None:
        headers["x-max-queue-wait-s"] = str(cfg.max_queue_wait_s)
    steps_in = [("concurrency", float(c)) for c in cfg.concurrency]
    steps_in += [("rate", r) for r in cfg.rates]
    prompts = load_prompts(cfg.source, cfg.requests * len(steps_in), cfg.max_tokens, cfg.seed)
    steps: list[StepResult] = []
    async with openai.AsyncOpenAI(
        base_url=base, api_key="bench", max_retries=0, timeout=cfg.timeout_s
    ) as client:
        for i, (kind, value) in enumerate(steps_in):
            chunk = prompts[i * cfg.requests : (i + 1) * cfg.requests]
            flight = _InFlight()
            started = time.perf_counter()
            if kind == "concurrency":
                samples = await _closed_loop(client, cfg.model, chunk, int(value), headers, flight)
            else:
                samples = await _open_loop(
                    client,
                    cfg.model,
                    chunk,
                    value,
                    cfg.burstiness,
                    cfg.max_concurrency,
                    cfg.seed + i,
                    headers,
                    flight,
                )
            wall = time.perf_counter() - started
            steps.append(
                summarize(
                    kind, value, samples, wall, flight.peak, cfg.p95_target_s, cfg.max_429_share
                )
            )
    return {
        "url": cfg.url,
        "model": cfg.model,
        "source": cfg.source,
        "requests_per_step": cfg.requests,
        "p95_target_s": cfg.p95_target_s,
        "burstiness": cfg.burstiness,
        "steps": [asdict(s) for s in steps],
        "sizing": sizing(steps, cfg.peak_concurrency, cfg.peak_rps),
    }


def run_client_bench(cfg: ClientBenchConfig) -> dict[str, Any]:
    return asyncio.run(run_async(cfg))


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def render(report: dict[str, Any], console: Console) -> None:
    table = Table(title=f"client-side TTFT, P95 target {report['p95_target_s']} s")
    for col in (
        "step",
        "sent",
        "ok",
        "429",
        "errors",
        "p50 s",
        "p95 s",
        "p99 s",
        "ok rps",
        "in flight",
        "meets",
    ):
        table.add_column(col, justify="right")
    for s in report["steps"]:
        label = f"c={int(s['value'])}" if s["kind"] == "concurrency" else f"{s['value']:g} rps"
        table.add_row(
            label,
            str(s["sent"]),
            str(s["ok"]),
            str(s["rejected_429"]),
            str(s["errors"]),
            _s(s["ttft_p50_s"]),
            _s(s["ttft_p95_s"]),
            _s(s["ttft_p99_s"]),
            f"{s['achieved_rps']:.2f}",
            str(s["peak_in_flight"]),
            "yes" if s["meets_target"] else "no",
        )
    console.print(table)
    size = report["sizing"]
    if size["best_step"] is None:
        console.print(f"sizing: {size['note']}")
        return
    best = size["best_step"]
    line = (
        f"sizing: best step {best['kind']} {best['value']:g} (concurrency "
        f"{best['concurrency']}, P95 {best['ttft_p95_s']:.3f} s); target "
        f"{size['target_rps_per_replica']:.2f} rps per replica"
    )
    if size.get("replicas") is not None:
        line += (
            f"; replicas = ceil({size['peak_concurrency']} / {best['concurrency']}) = "
            f"{size['replicas']}"
        )
    if size.get("replicas_by_rate") is not None:
        line += f"; by rate: {size['replicas_by_rate']}"
    console.print(line)
