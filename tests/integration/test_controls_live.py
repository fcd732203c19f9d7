"""Workload classes and latency controls on the live stack (worker, fleet, ingest, router on
the real broker), and `foretoken bench client` against it:

* the bench client (a real subprocess, the official openai client) prints the per-step
  table and the sizing, and its JSON adds up;
* a request naming an unknown workload class is a clear 400;
* a burst of interactive requests whose queue time exceeds the class's budget makes the
  worker publish a ControlEvent (ok → warn, with its reason) on the `controls` topic, and
  /v1/controls and /metrics show the class's stage."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from aiokafka import AIOKafkaConsumer

from foretoken.adapters.processes import get_json
from foretoken.settings import Settings
from foretoken.wire.codec import decode
from foretoken.wire.records import ControlEvent
from tests.integration.stack import Stack, start_stack

pytestmark = pytest.mark.integration
MODEL = "sim-small"
CONFIG = """
[controls]
default_class = "interactive"
window_s = 60.0
min_samples = 2
breach_s = 0.5
recovery_s = 600.0
evaluate_every_s = 0.5
corroborating_queue_tokens = 1

[controls.classes.interactive]
objective_ttft_s = 1.0
non_queue_latency_s = 0.2
margin_s = 0.0
priority = 10
protected = true

[controls.classes.batch]
objective_ttft_s = 600.0
non_queue_latency_s = 5.0
margin_s = 5.0
priority = 0
"""


@pytest.fixture(scope="module")
def stack(kafka_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("controls")
    config = tmp / "classes.toml"
    config.write_text(CONFIG)
    # Engines four times slower than their hidden truth: queueing piles up within a burst.
    s = start_stack(
        kafka_settings,
        tmp,
        time_scale=4.0,
        route_timeout_s=3.0,
        extra_env={"FORETOKEN_CONFIG": str(config)},
    )
    yield s
    s.stop_all()


def _bench(stack: Stack, tmp: Path, *args: str) -> tuple[dict[str, object], str]:
    cmd = [
        sys.executable,
        "-m",
        "foretoken.cli",
        "bench",
        "client",
        "--url",
        stack.router_url,
        "--model",
        MODEL,
        *args,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout), done.stderr


def test_bench_client_prints_steps_and_sizing(stack: Stack, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "\n".join(f"write a function number {i} that adds two numbers" for i in range(20))
    )
    report, table = _bench(
        stack,
        tmp_path,
        "--concurrency",
        "1,3",
        "--requests",
        "6",
        "--prompts",
        str(prompts),
        "--max-tokens",
        "2",
        "--p95-target-s",
        "60",
        "--peak-concurrency",
        "10",
        "--workload-class",
        "batch",
    )
    steps = report["steps"]
    assert isinstance(steps, list) and [s["value"] for s in steps] == [1.0, 3.0]
    for step in steps:
        assert step["sent"] == 6
        assert step["ok"] + step["rejected_429"] + step["errors"] == 6
        assert step["ok"] > 0 and step["ttft_p95_s"] is not None
        assert step["ttft_p50_s"] <= step["ttft_p95_s"] <= step["ttft_p99_s"]
    sizing = report["sizing"]
    assert isinstance(sizing, dict)
    best = sizing["best_step"]
    meeting = [s for s in steps if s["meets_target"]]
    assert meeting and best["concurrency"] == max(int(s["value"]) for s in meeting)
    assert sizing["replicas"] == math.ceil(10 / best["concurrency"])
    assert sizing["target_rps_per_replica"] > 0
    assert "client-side TTFT" in table and "sizing:" in table and "replicas" in table


def test_an_unknown_workload_class_is_a_clear_400(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.router_url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="unknown workload class"):
        client.completions.create(
            model=MODEL, prompt="hi", max_tokens=1, extra_headers={"x-workload-class": "nope"}
        )


async def _control_events(settings: Settings, timeout_s: float) -> list[ControlEvent]:
    consumer = AIOKafkaConsumer(
        settings.topic("controls"),
        bootstrap_servers=settings.kafka.bootstrap_servers,
        auto_offset_reset="earliest",
        group_id=f"t-{uuid.uuid4().hex[:6]}",
    )
    await consumer.start()
    events: list[ControlEvent] = []
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not events:
            for msgs in (await consumer.getmany(timeout_ms=500)).values():
                events += [decode(m.value, ControlEvent) for m in msgs]
    finally:
        await consumer.stop()
    return events


def test_a_queue_time_breach_is_a_control_event_on_the_controls_topic(
    stack: Stack, tmp_path: Path
) -> None:
    # 24 long prompts at once on three slow engines: the last ones queue for seconds,
    # far past the interactive class's 0.8 s queue budget (warn at 0.4 s).
    report, _ = _bench(
        stack,
        tmp_path,
        "--concurrency",
        "24",
        "--requests",
        "24",
        "--prompts",
        "azure-code",
        "--max-tokens",
        "2",
        "--p95-target-s",
        "1",
        "--workload-class",
        "interactive",
    )
    assert report["steps"][0]["ok"] > 0  # type: ignore[index]
    events = asyncio.run(_control_events(stack.worker.settings, 90.0))
    assert events, "no control event on the controls topic"
    first = events[0]
    assert first.workload_class == "interactive"
    assert (first.from_stage, first.to_stage) == ("ok", "warn")
    assert first.objective_ttft_s == 1.0 and first.queue_budget_s == pytest.approx(0.8)
    assert first.tail_queue_s is not None and first.tail_queue_s >= first.threshold_s
    assert first.remaining_budget_s == pytest.approx(0.8 - first.tail_queue_s)
    assert first.reason and first.samples >= 2
    page = get_json(f"{stack.worker.url}/v1/controls")
    assert page["default_class"] == "interactive" and "batch" in page["classes"]
    staged = [t for t in page["tracks"] if t["stage"] != "ok"]
    assert staged and all(t["workload_class"] == "interactive" for t in staged)
    assert page["recent"] and page["signals"]
    with urllib.request.urlopen(f"{stack.worker.url}/metrics") as r:
        metrics = r.read().decode()
    stage_lines = [ln for ln in metrics.splitlines() if ln.startswith("foretoken_control_stage{")]
    assert any(
        'workload_class="interactive"' in ln and not ln.endswith(" 0.0") for ln in stage_lines
    ), stage_lines
    assert "foretoken_control_transitions_total" in metrics
