"""The latency controls on the dashboard: a lake with control events shows the section with
each change and its reason; a lake without them shows no section."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from foretoken.adapters.dashboard import APP_PATH
from foretoken.core.types import WorkerId
from foretoken.sim.classes import write_control_events
from foretoken.wire.records import ControlEvent, ControlSignals

APP = APP_PATH
STAGES = ("ok", "warn", "reroute", "admission")


def _event(ts: float, frm: str, to: str, worker: str = "w0") -> ControlEvent:
    return ControlEvent(
        ts=ts,
        workload_class="interactive",
        worker_id=WorkerId(worker),
        from_stage=frm,  # type: ignore[arg-type]
        to_stage=to,
        reason=f"{frm}->{to} because",
        objective_ttft_s=2.0,
        percentile=95.0,  # type: ignore[arg-type]
        queue_budget_s=1.25,
        tail_queue_s=3.0,
        remaining_budget_s=-1.75,
        threshold_s=1.0,
        samples=40,
        signals=ControlSignals(queue_tokens=9000, peak_queue_tokens=20000),
    )


def _run(monkeypatch: pytest.MonkeyPatch, lake: Path) -> AppTest:
    monkeypatch.setenv("FORETOKEN_LAKE", str(lake))
    at = AppTest.from_file(str(APP), default_timeout=120).run()
    assert not at.exception, at.exception
    return at


def test_control_changes_are_shown_with_their_reasons(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    t = 1_750_000_000.0
    events = [_event(t + 10 * i, STAGES[i], STAGES[i + 1]) for i in range(3)]
    events.append(_event(t + 50, "ok", "warn", worker="w1"))
    write_control_events(events[:2], tmp_path)
    write_control_events(events[2:], tmp_path)  # two files: both are read
    at = _run(monkeypatch, tmp_path)
    assert "Latency controls" in [h.value for h in at.subheader]
    shown = {m.label: m.value for m in at.metric}
    assert shown["State changes"] == "4"
    assert shown["Tracks now at admission"] == "1" and shown["Tracks now at warn"] == "1"
    table = next(d.value for d in at.dataframe if "reason" in d.value.columns)
    assert len(table) == 4 and "reroute->admission because" in set(table["reason"])


def test_no_section_without_control_events(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    at = _run(monkeypatch, tmp_path)
    assert "Latency controls" not in [h.value for h in at.subheader]
