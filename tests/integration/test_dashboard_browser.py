"""The grading dashboard as users see it: a lake built by `foretoken replay` (a real
process), `streamlit run` on the dashboard app (a real server), and Debian's chromium driven by
playwright. Every tab is visited, its key text checked against the lake, and a screenshot
saved to docs/img/dashboard-<page>.png."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pytest

try:
    from playwright.sync_api import Browser, Page, sync_playwright
except ImportError as exc:  # a dev dependency: say what to install
    raise ImportError(
        "playwright is missing: `pip install playwright` (a dev dependency). Do not run "
        "`playwright install`: this test drives Debian's chromium (/usr/bin/chromium)."
    ) from exc

from foretoken.adapters.dashboard import APP_PATH
from foretoken.adapters.processes import foretoken_cmd, spawn, stop
from tests.conftest import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
APP = APP_PATH
SHOTS = ROOT / "docs" / "img"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
REPLAY = ["--limit", "800", "--capacity-factor", "0.8", "--bounds", "5:0.3,10:0.3,30:0.4",
          "--no-progress"]  # fmt: skip
START_S = 90.0
RENDER_MS = 60_000
WIDTH = 1440
MIN_HEIGHT = 1000
MAX_HEIGHT = 4000
SETTLE_MS = 1500  # let Vega finish drawing before a screenshot
# tab → (file slug, text that shows the tab's content is there)
PAGES = {
    "Overview": ("overview", "Trend per"),
    "Predicted vs actual": ("predicted-vs-actual", None),
    "Fits": ("fits", "prefill curve"),
    "Bounds": ("bounds", "Same side of B"),
}


@dataclass(frozen=True, slots=True)
class Lake:
    path: Path
    policy: str
    frame: pl.DataFrame

    @property
    def has_predictions(self) -> bool:
        return bool(self.frame["predicted_ttft_s"].is_not_null().any())


@pytest.fixture(scope="module")
def lake(tmp_path_factory: pytest.TempPathFactory) -> Lake:
    """Replayed with the predictor policy when it is registered, else round-robin (then
    the lake has no predictions, and the dashboard must say so)."""
    out = tmp_path_factory.mktemp("dashboard") / "lake"
    for policy in ("predictor", "round-robin"):
        cmd = foretoken_cmd("replay", "--policy", policy, *REPLAY, "--out", str(out))
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
        if done.returncode == 0:
            frame = pl.read_parquet(str(out / "graded" / "*" / "part-*.parquet"))
            return Lake(out, policy, frame)
        if "unknown policy" not in done.stdout + done.stderr:
            pytest.fail(f"foretoken replay failed:\n{done.stdout}\n{done.stderr}")
    pytest.fail("no routing policy to replay with")


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"streamlit exited with {proc.returncode}:\n{log.read_text()}")
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(url + "/_stcore/health", timeout=2) as resp,
        ):
            if resp.status == 200:
                return
        time.sleep(0.2)
    pytest.fail(f"streamlit did not answer within {START_S} s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def dashboard(lake: Lake, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("streamlit") / "streamlit.log"
    cmd = [sys.executable, "-m", "streamlit", "run", str(APP), "--server.headless", "true",
           "--server.port", str(port), "--server.address", "127.0.0.1",
           "--browser.gatherUsageStats", "false", "--client.toolbarMode", "minimal",
           "--server.fileWatcherType", "none", "--", "--lake", str(lake.path)]  # fmt: skip
    proc = spawn(cmd, {"FORETOKEN_DASHBOARD_REFRESH_S": "0"}, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: the dashboard browser test drives Debian's chromium. "
            "Install it with `apt-get update && apt-get install -y chromium` (CI installs it)."
        )
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def screenshot(page: Page, name: str) -> Path:
    """The whole page: Streamlit scrolls inside its main block, so grow the viewport to the
    content's height rather than asking for a full-page shot."""
    height = page.evaluate(
        "() => document.querySelector('[data-testid=\"stMainBlockContainer\"]').scrollHeight"
    )
    height = min(max(int(height) + 160, MIN_HEIGHT), MAX_HEIGHT)
    page.set_viewport_size({"width": WIDTH, "height": height})
    page.wait_for_timeout(SETTLE_MS)
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"dashboard-{name}.png"
    page.screenshot(path=str(path))
    return path


def test_every_page_renders_in_chromium(lake: Lake, dashboard: str, browser: Browser) -> None:
    page = browser.new_page(viewport={"width": WIDTH, "height": 1000})
    page.goto(dashboard)
    page.wait_for_selector('[data-testid="stMetric"]', timeout=RENDER_MS)
    page.get_by_text(re.compile(r"^Read \d{4}-")).wait_for(timeout=RENDER_MS)  # all drawn
    assert "foretoken · prediction grades" in page.inner_text("h1")

    served = lake.frame.filter(pl.col("status") == "served").height
    rejected = lake.frame.filter(pl.col("status") == "rejected").height
    text = page.inner_text('[data-testid="stMainBlockContainer"]')
    assert f"{served:,} / {rejected:,}" in text  # the Served / rejected card, from the lake
    assert ("No predictions in this lake" in text) != lake.has_predictions, lake.policy

    sidebar = page.inner_text('[data-testid="stSidebar"]')
    for label in ("Model", "Worker", "Workload class", "Time range (UTC)", "Auto-refresh"):
        assert label in sidebar

    saved = []
    for tab, (slug, marker) in PAGES.items():
        page.get_by_role("tab", name=tab).click()
        panel = page.locator('[role="tabpanel"]:visible')
        if marker is None:  # the scatter page: a chart, or the no-predictions note
            marker = "served requests with a prediction" if lake.has_predictions else (
                "No predictions in this lake")  # fmt: skip
        panel.get_by_text(marker, exact=False).first.wait_for(timeout=RENDER_MS)
        charts = panel.locator('[data-testid="stVegaLiteChart"]')
        for i in range(charts.count()):
            charts.nth(i).locator("canvas, svg").first.wait_for(timeout=RENDER_MS)
        assert not page.locator('[data-testid="stException"]').count(), tab
        saved.append(screenshot(page, slug))
    assert all(p.stat().st_size > 10_000 for p in saved)
    page.close()
