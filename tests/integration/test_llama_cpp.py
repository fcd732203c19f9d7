"""A real engine in the loop (issue #9): a llama.cpp server (llama-cpp-python built from PyPI
by ``ops/llama_wheel.py``) serving a GGUF generated here, behind the router, with the Faust
worker and ingest on the real broker.

What is checked: the engine serves both OpenAI endpoints, streaming, through the router, and
counts tokens as the router does (byte-level vocabulary); its reuse of a prompt prefix is
real; the route service models it as a serial engine through its registered settings (a
request sent behind another is predicted to wait for it); and the predictor's fitted curve
for it (``GET /v1/fits``) moves from the default to the curve measured directly on the
engine — learned only from TTFTs the router measured (the engines file holds no cost).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from foretoken.adapters.engines.engines_file import load_engines
from foretoken.adapters.kafka.graded_reader import read_graded
from foretoken.ops.llama_stack import LlamaStack, fit_quadratic, random_text, start_llama_stack
from foretoken.ops.llama_stack import stream_completion as complete
from foretoken.ops.llama_wheel import ensure_installed
from foretoken.settings import Settings
from foretoken.sim.live.llama_server import LlamaServerConfig

# Long timeout: on a machine without the cached wheel, the first test's fixture waits for the
# llama-cpp-python build that `make test` started in the background (minutes).
# alone: the fit's samples and the engine's own curve are measured minutes apart; with
# another test process beside it the engine ran 2.2x slower in one of them (a fresh CI run).
pytestmark = [pytest.mark.integration, pytest.mark.alone, pytest.mark.timeout(2400)]
N_CTX = 8704
SIZES = (512, 1024, 2048, 3072, 4096, 6144, 8192)
# The learned curve must land near the engine's measured one at every size: the fit sees
# the router's TTFT (engine + HTTP hops), so it may sit a little above; a run on a loaded
# 2-core machine is noisy, hence the generous band.
LOW, HIGH, ALLOWANCE_S = 0.6, 1.6, 0.05


@pytest.fixture(scope="module")
def stack(
    kafka_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaStack]:
    # Always through the build lock: `make test`'s background install holds it, and while
    # pip is still writing the package the import checks can already pass.
    ensure_installed()  # builds once (cached), or waits for `make test`'s build and install
    env = {"FORETOKEN_TOPIC_PREFIX": kafka_settings.topic_prefix, "FORETOKEN_LOG_LEVEL": "warn",
           "KAFKA_BOOTSTRAP_SERVERS": kafka_settings.kafka.bootstrap_servers}  # fmt: skip
    run_dir = tmp_path_factory.mktemp("llama")
    s = start_llama_stack(env, run_dir, count=1, cfg=LlamaServerConfig(n_ctx=N_CTX))
    yield s
    s.stop_all()


def test_engines_file_has_no_costs_and_no_events(stack: LlamaStack) -> None:
    (engine,) = load_engines(stack.run_dir / "engines.toml")
    assert engine.engine == "llamacpp" and not engine.kv_events
    assert not engine.reports_cached_tokens
    assert engine.scheduler.max_num_seqs == 1 and not engine.scheduler.chunked_prefill
    reg = engine.registration()
    assert not reg.has_kv_events
    # Registered on the workers topic by ingest; the route service serves it.
    assert stack.fits()[engine.worker_id]["default"]


def test_serves_both_endpoints_streaming_through_the_router(stack: LlamaStack) -> None:
    rng = random.Random(1)
    prompt = random_text(rng, 300)
    # Not streamed, the engine reports usage: it counts tokens as the router's tokenizer does
    # (one byte, one token) and says nothing of cached tokens. (Streamed, it sends no usage.)
    body = {"model": stack.model, "prompt": prompt, "max_tokens": 4}
    usage = post_json(stack.llamas[0].url + "/v1/completions", body)["usage"]
    assert usage["prompt_tokens"] == len(prompt.encode())
    assert "prompt_tokens_details" not in usage
    routed = complete(stack.router_url, stack.model, prompt, max_tokens=4)
    assert routed.ttft_s is not None and routed.text.strip()
    whole = post_json(stack.router_url + "/v1/completions", body)
    assert whole["choices"][0]["text"]
    chat = complete(stack.router_url, stack.model, "hello there", max_tokens=4,
                    path="/v1/chat/completions")  # fmt: skip
    assert chat.ttft_s is not None and chat.text


def test_prefix_reuse_is_real(stack: LlamaStack) -> None:
    rng = random.Random(2)
    base = random_text(rng, 6000)
    url = stack.llamas[0].url
    cold = complete(url, stack.model, base).ttft_s
    warm = complete(url, stack.model, base + random_text(rng, 64)).ttft_s
    other = complete(url, stack.model, random_text(rng, 6000)).ttft_s
    assert cold is not None and warm is not None and other is not None
    assert warm < cold / 3 and warm < other / 3, (cold, warm, other)


def test_serial_engine_queue_is_predicted(stack: LlamaStack) -> None:
    """Two requests at once: the engine runs them one after the other, and the route
    service — from the registered settings alone — predicts that the one it routes later
    waits for the other (whichever the router's threads got to first)."""
    rng = random.Random(3)
    prompts = [random_text(rng, 6000) for _ in range(2)]  # ~1 s of prefill each
    ids = [f"serial-{i}-{rng.randrange(1 << 30)}" for i in range(2)]
    kwargs = {"headers": {"x-request-id": ids[0]}, "max_tokens": 4}
    args = (stack.router_url, stack.model, prompts[0])
    first = threading.Thread(target=complete, args=args, kwargs=kwargs)
    first.start()
    time.sleep(0.3)
    complete(stack.router_url, stack.model, prompts[1], headers={"x-request-id": ids[1]},
             max_tokens=4)  # fmt: skip
    first.join()
    settings = _settings(stack)
    graded = {g.request_id: g for g in asyncio.run(read_graded(settings, 60.0, idle_s=5.0))}
    assert set(ids) <= set(graded), "both requests graded"
    # llama-cpp-python streams no usage: the router counts the streamed tokens itself.
    assert graded[ids[0]].output_tokens == 4
    earlier, later = sorted((graded[i] for i in ids), key=lambda g: g.ts)
    assert not earlier.fallback and not later.fallback, "both decided by the route service"
    assert earlier.actual_ttft_s is not None and later.actual_ttft_s is not None
    # one sequence at a time: the later one waits, whether the earlier prefills or decodes
    assert (later.queue_wait_s or 0) > 0
    earlier_first_token = earlier.ts + earlier.actual_ttft_s
    if earlier_first_token > later.ts:  # the earlier one was still prefilling
        assert later.queue_tokens_ahead > 0
        assert later.actual_ttft_s > earlier_first_token - later.ts  # it did wait for it


def test_fit_learns_the_engines_curve(stack: LlamaStack) -> None:
    rng = random.Random(4)
    url = stack.llamas[0].url
    measured = []
    for n in SIZES:  # the engine's own cold curve, measured directly (the baseline)
        ttft = complete(url, stack.model, random_text(rng, n)).ttft_s
        assert ttft is not None
        measured.append((n, ttft))
    a, b = fit_quadratic(measured)
    assert b > 0, f"no quadratic term measured: {measured}"
    wid = stack.llamas[0].worker_id
    deadline = time.monotonic() + 120
    fit: dict[str, object] = stack.fits()[wid]
    # Judged once the curve comes from cold samples (8 at least): before that a busy-chain
    # bootstrap answers (`a` alone, `b` fixed near 0), which this engine's quadratic cost
    # puts 2x low at 8k tokens.
    while time.monotonic() < deadline and fit["source"] != "cold":
        for n in rng.sample(list(SIZES), len(SIZES)):  # one at a time: each alone
            complete(stack.router_url, stack.model, random_text(rng, n))
        time.sleep(1.0)
        fit = stack.fits()[wid]
    assert fit["source"] == "cold" and not fit["default"], f"no cold fit: {fit}"
    for n in (1024, 4096, 8192):
        fitted = float(fit["a"]) * n + float(fit["b"]) * n * n  # type: ignore[arg-type]
        engine = a * n + b * n * n
        assert LOW * engine <= fitted <= HIGH * engine + ALLOWANCE_S, (
            f"{n} tokens: fitted {fitted:.3f} s, engine {engine:.3f} s; fit {fit}; "
            f"measured {measured}"
        )


def post_json(url: str, body: dict[str, object]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as resp:
        out: dict[str, Any] = json.loads(resp.read())
    return out


def _settings(stack: LlamaStack) -> Settings:
    import os

    from foretoken.settings import load_settings

    return load_settings(env={**os.environ, **stack.env})
