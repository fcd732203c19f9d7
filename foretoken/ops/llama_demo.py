"""``make demo ENGINES=llama`` (``foretoken demo --engines llama``): the live pipeline in
front of two real llama.cpp engines instead of the simulated fleet.

Kafka → the Faust worker → two llama.cpp servers (llama-cpp-python, the generated tiny GGUF;
no KV events, no cached-token reports) → ingest (registration only) → the router. Then cold
prompts of 512..16k tokens, one at a time, while the predictor learns each engine's curve;
then a mixed stream with queueing (cold prompts and conversation follow-ups). It prints the
learned curves next to the TTFTs measured on the engines themselves, what the client saw,
and the grades.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import statistics
import uuid

from rich.table import Table

from foretoken.adapters.kafka.graded_reader import read_graded
from foretoken.adapters.kafka.topics import ensure_topics
from foretoken.adapters.lake.report import output_console, print_table
from foretoken.adapters.ports import in_use
from foretoken.ops import kafka_local
from foretoken.ops.demo import keep_running
from foretoken.ops.llama_measure import (
    FULL,
    _mixed_async,
    curve_at,
    engine_curve,
    grade_mixed,
    learn,
)
from foretoken.ops.llama_stack import LlamaStack, start_llama_stack
from foretoken.settings import Settings, load_settings
from foretoken.sim.live.llama_server import LlamaServerConfig

ROUTER_PORT = 8000
ENGINES = 2
DEMO = dataclasses.replace(FULL, repeats=1)
console = output_console()


def run_llama_demo(settings: Settings, keep: bool = False) -> int:
    console.rule("[bold]foretoken demo: real llama.cpp engines")
    st, started_broker = kafka_local.up(settings)
    console.print(f"broker: {st.describe()}")
    prefix = f"demollama{uuid.uuid4().hex[:4]}-"
    env = {"FORETOKEN_TOPIC_PREFIX": prefix, "FORETOKEN_LOG_LEVEL": "warn",
           "KAFKA_BOOTSTRAP_SERVERS": settings.kafka.bootstrap_servers}  # fmt: skip
    demo_settings = load_settings(env={**os.environ, **env})
    asyncio.run(ensure_topics(demo_settings))
    stack: LlamaStack | None = None
    run_dir = settings.state_path / "demo-llama"
    try:
        port = None if in_use("127.0.0.1", ROUTER_PORT) else ROUTER_PORT
        cfg = LlamaServerConfig(n_ctx=DEMO.n_ctx)
        stack = start_llama_stack(env, run_dir, count=ENGINES, cfg=cfg, router_port=port)
        console.print(f"{ENGINES} llama.cpp engines, worker, ingest, router: up "
                      f"(router {stack.router_url}/v1, model {stack.model})")  # fmt: skip
        rng = random.Random(0)
        console.rule("the engines' own cold curves (sent directly, one at a time)")
        measured = engine_curve(stack, DEMO, rng)
        console.rule("cold prompts through the router, one at a time: the fits learn")
        learned = learn(stack, DEMO, rng)
        console.print(f"{learned['requests']} requests in {learned['wall_s']} s; "
                      f"learned: {learned['learned']}")  # fmt: skip
        _show_fits(stack, measured)
        console.rule(f"a mixed stream with queueing: {DEMO.mixed_requests} requests")
        sizes = DEMO.mixed_sizes
        mean_prefill = statistics.mean(
            statistics.mean(curve_at(m["a"], m["b"], n) for n in sizes) for m in measured.values()
        )
        mixed = asyncio.run(_mixed_async(stack, DEMO, rng, mean_prefill + 0.1))
        graded = asyncio.run(read_graded(demo_settings, 60.0, idle_s=8.0))
        _show_accuracy(grade_mixed(graded, mixed["kinds"]), mixed["failed"])
        console.print(f"\nrouter: {stack.router_url}/v1  ·  worker: {stack.worker_url}/v1/fits"
                      f"  ·  logs: {run_dir}/")  # fmt: skip
        if keep:
            keep_running()
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        if stack is not None:
            stack.stop_all()
        if started_broker:
            kafka_local.down(settings)


def _show_fits(stack: LlamaStack, measured: dict[str, dict[str, float]]) -> None:
    table = Table(title="prefill curves: learned online vs measured on the engine")
    table.add_column("worker")
    table.add_column("samples", justify="right")
    for n in (2048, 8192, 16384):
        table.add_column(f"C({n // 1024}k) fit", justify="right")
        table.add_column(f"C({n // 1024}k) engine", justify="right")
    for wid, fit in stack.fits().items():
        m = measured.get(wid)
        row = [wid, f"{fit['samples']}{' (default)' if fit['default'] else ''}"]
        for n in (2048, 8192, 16384):
            row.append(f"{curve_at(float(fit['a']), float(fit['b']), n):.2f} s")  # type: ignore[arg-type]
            row.append(f"{curve_at(m['a'], m['b'], n):.2f} s" if m else "-")
        table.add_row(*row)
    print_table(console, table)


def _show_accuracy(accuracy: dict[str, dict[str, float]], failed: int) -> None:
    table = Table(title="predicted vs actual TTFT (graded topic); bar: within max(10%, 0.2 s)")
    for col in ("requests", "served", "within bar", "|err| p50", "|err| p90", "TTFT p50"):
        table.add_column(col, justify="right")
    for kind in ("cold", "follow_up", "all"):
        a = accuracy.get(kind)
        if a is None:
            continue
        table.add_row(kind, str(a["served"]), f"{100 * a['share_within']:.0f}%",
                      f"{a['abs_error_p50_s']:.2f} s", f"{a['abs_error_p90_s']:.2f} s",
                      f"{a['actual_ttft_p50_s']:.2f} s")  # fmt: skip
    print_table(console, table)
    if failed:
        console.print(f"[red]{failed} requests failed[/red]")
