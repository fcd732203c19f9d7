"""The client benchmark's pure parts: step summaries (429s apart, the target), replica
sizing, and prompts from dataset files; and the replay's class mix and per-class goodput."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from foretoken.bench.client_bench import ClientBenchConfig, Sample, load_prompts, sizing, summarize
from foretoken.core.types import RequestId
from foretoken.settings import ControlSettings, WorkloadClass
from foretoken.sim.classes import ClassMix, class_summary
from foretoken.sim.traces import TraceRequest
from foretoken.wire.records import Graded


def _samples(ttfts: list[float], n429: int = 0, errors: int = 0) -> list[Sample]:
    out = [Sample(True, 200, t, t + 0.1) for t in ttfts]
    out += [Sample(False, 429, error="429: slow down") for _ in range(n429)]
    out += [Sample(False, None, error="APIConnectionError") for _ in range(errors)]
    return out


def test_a_step_counts_429s_apart_and_judges_the_p95_target() -> None:
    ttfts = [0.1 * i for i in range(1, 21)]
    step = summarize("concurrency", 4, _samples(ttfts, n429=1, errors=2), 10.0, 4, 2.0, 0.05)
    assert (step.sent, step.ok, step.rejected_429, step.errors) == (23, 20, 1, 2)
    assert step.ttft_p95_s == pytest.approx(float(np.percentile(ttfts, 95)))
    assert step.ttft_p50_s is not None and step.ttft_p95_s is not None
    assert step.ttft_p50_s < step.ttft_p95_s
    assert step.achieved_rps == pytest.approx(2.0)
    assert step.meets_target  # p95 1.905 s <= 2 s, 1 of 23 rejected <= 5 %
    assert step.first_errors == ["APIConnectionError", "APIConnectionError"]
    strict = summarize("concurrency", 4, _samples(ttfts), 10.0, 4, 1.5, 0.05)
    assert not strict.meets_target
    shed = summarize("concurrency", 4, _samples(ttfts[:5], n429=15), 10.0, 4, 2.0, 0.05)
    assert not shed.meets_target  # fast only because most were turned away
    empty = summarize("rate", 2.0, _samples([], errors=3), 1.0, 3, 2.0, 0.05)
    assert empty.ttft_p95_s is None and not empty.meets_target


def test_sizing_takes_the_highest_step_that_meets_the_target() -> None:
    steps = [
        summarize("concurrency", c, _samples([p95] * 20), 10.0, c, 2.0, 0.05)
        for c, p95 in ((1, 0.5), (4, 1.5), (8, 1.9), (16, 4.0))
    ]
    out = sizing(steps, peak_concurrency=100, peak_rps=9.0)
    assert out["best_step"]["concurrency"] == 8
    assert out["replicas"] == math.ceil(100 / 8)
    assert out["target_rps_per_replica"] == pytest.approx(2.0)
    assert out["replicas_by_rate"] == math.ceil(9.0 / 2.0)
    rate_step = summarize("rate", 3.0, _samples([1.0] * 30), 10.0, 6, 2.0, 0.05)
    assert sizing([rate_step], 60, None)["replicas"] == 10  # its concurrency: most in flight
    none = sizing(steps[-1:], 100, None)
    assert none["best_step"] is None and none["replicas"] is None


def test_prompts_from_dataset_files(tmp_path: Path) -> None:
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text(
        json.dumps({"prompt": "alpha"}) + "\n" + json.dumps({"text": "beta"}) + "\n"
        + json.dumps({"conversations": [{"from": "human", "value": "gamma"}]}) + "\n"
    )  # fmt: skip
    got = load_prompts(str(jsonl), 7, max_tokens=5)
    assert len(got) == 7 and {p.prompt for p in got} == {"alpha", "beta", "gamma"}
    assert all(p.max_tokens == 5 for p in got)
    txt = tmp_path / "d.txt"
    txt.write_text("one\n\ntwo\n")
    assert {p.prompt for p in load_prompts(str(txt), 4, 3)} == {"one", "two"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"nothing": 1}) + "\n")
    with pytest.raises(ValueError, match="row 1"):
        load_prompts(str(bad), 1, 3)
    with pytest.raises(ValueError, match="no dataset file"):
        load_prompts(str(tmp_path / "missing.jsonl"), 1, 3)
    with pytest.raises(ValueError, match="steps"):
        ClientBenchConfig(url="http://x", model="m")


CLASSES = ControlSettings(
    default_class="chat",
    classes={
        "chat": WorkloadClass(objective_ttft_s=2.0, non_queue_latency_s=0.5, margin_s=0.5,
                              max_queue_wait_s=10.0, priority=5, protected=True),
        "batch": WorkloadClass(objective_ttft_s=60.0),
    },
)  # fmt: skip


def _trace(n: int) -> list[TraceRequest]:
    return [TraceRequest(request_id=RequestId(f"r{i}"), arrival_s=float(i), prompt_tokens=10,
                         output_tokens=1, segment_keys=(i,), segment_lengths=(10,))
            for i in range(n)]  # fmt: skip


def test_a_class_mix_is_exact_and_gives_default_bounds() -> None:
    mixed = ClassMix.parse("chat:0.3,batch:0.7").assign(_trace(100), CLASSES, seed=3)
    chat = [r for r in mixed if r.workload_class == "chat"]
    assert len(chat) == 30 and all(r.max_queue_wait_s == 10.0 for r in chat)
    assert all(r.max_queue_wait_s is None for r in mixed if r.workload_class == "batch")
    again = ClassMix.parse("chat:0.3,batch:0.7").assign(_trace(100), CLASSES, seed=3)
    assert [r.workload_class for r in again] == [r.workload_class for r in mixed]
    with pytest.raises(ValueError, match="unknown workload class"):
        ClassMix.parse("chat:0.5,other:0.5").assign(_trace(4), CLASSES)
    with pytest.raises(ValueError, match="sum to 1"):
        ClassMix.parse("chat:0.5,batch:0.6")


def test_class_goodput_counts_rejections_against_the_class() -> None:
    def rec(i: int, klass: str, actual: float | None, status: str = "served") -> Graded:
        return Graded(request_id=RequestId(f"g{i}"), ts=0.0, model="m", workload_class=klass,  # type: ignore[arg-type]
                      worker_id=None, status=status, admitted=status == "served",  # type: ignore[arg-type]
                      prompt_tokens=10, actual_ttft_s=actual)  # fmt: skip

    records = [rec(0, "chat", 1.0), rec(1, "chat", 3.0), rec(2, "chat", None, "rejected"),
               rec(3, "batch", 30.0)]  # fmt: skip
    out = class_summary(records, CLASSES)
    assert out["chat"]["requests"] == 3 and out["chat"]["served"] == 2
    assert out["chat"]["goodput"] == 1 and out["chat"]["goodput_fraction"] == pytest.approx(1 / 3)
    assert out["batch"]["goodput"] == 1
