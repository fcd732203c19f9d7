"""Fleet (real time), ingest, worker and route service on the real broker: predictions are
served, grants and outcomes flow, and each worker's fitted prefill curve moves from the
default toward the engine's hidden truth (which only this test reads, to check)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import openai
import pytest

from foretoken.adapters.processes import get_json
from foretoken.settings import Settings
from foretoken.sim.spec import load_fleet
from tests.integration.stack import Stack, start_stack

pytestmark = pytest.mark.integration
MODEL = "sim-small"
TIME_SCALE = 1.0
# The fit learns TTFT as the router measures it: the engine's prefill plus its step overheads
# and the HTTP hops (tens of ms here), which the N-linear term absorbs. So the fitted cost at
# 6k tokens must land between the true prefill and 1.6x it plus a fixed allowance.
OVERHEAD_ALLOWANCE_S = 0.05
UPPER_FACTOR = 1.6


@pytest.fixture(scope="module")
def stack(kafka_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(kafka_settings, tmp_path_factory.mktemp("stack"), time_scale=TIME_SCALE)
    yield s
    s.stop_all()


def _fits(stack: Stack) -> dict[str, dict]:  # type: ignore[type-arg]
    return {f["worker_id"]: f for f in get_json(f"{stack.worker.url}/v1/fits")["fits"]
            if f["current"]}  # fmt: skip


def test_fits_learn_each_engines_curve(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.router_url + "/v1", api_key="k", max_retries=0)
    rng = random.Random(5)
    assert all(f["default"] for f in _fits(stack).values())
    deadline = time.monotonic() + 150
    sizes = [1000, 2000, 3000, 4000, 5000, 6000, 7000, 7800]
    learned: dict[str, dict] = {}  # type: ignore[type-arg]
    while time.monotonic() < deadline:
        for n in sizes:  # one at a time: each request is alone on its worker
            prompt = [rng.randrange(16, 30000) for _ in range(n)]
            reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
            assert reply.choices[0].text
        time.sleep(1.0)  # let the last graded records reach the fits
        learned = {w: f for w, f in _fits(stack).items() if not f["default"]}
        if len(learned) == len(stack.engines):
            break
    assert len(learned) == len(stack.engines), f"still on the default: {_fits(stack)}"
    truth = {e.id: e.truth for e in load_fleet("small").engines}
    for wid, fit in learned.items():
        n = 6000
        fitted = fit["a"] * n + fit["b"] * n * n
        true = truth[wid].prefill_s(n) * TIME_SCALE
        assert 0.8 * true <= fitted <= UPPER_FACTOR * true + OVERHEAD_ALLOWANCE_S, (
            wid,
            fitted,
            true,
        )
    default = 1.5e-4 * 6000 + 2.5e-9 * 6000**2
    assert all(f["a"] * 6000 + f["b"] * 36e6 < default / 2 for f in learned.values())
    # every answer used its whole max_tokens (the simulated engines stop there): the route
    # service learned that from the router's completions, so caps here stay lengths
    lengths = get_json(f"{stack.worker.url}/v1/fits")["output_lengths"][MODEL]
    assert lengths["capped_samples"] > 0 and lengths["share_of_cap"] == 1.0
