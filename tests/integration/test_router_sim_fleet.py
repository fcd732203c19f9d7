"""The router in front of the simulated fleet (real processes and broker; the router
decides alone): the official SDKs get cached tokens in the usage from the engine that holds
the prefix, a batch of prompts is answered as one, the engines' own /tokenize is passed
through, and SGLang's native /generate is routed and measured."""

from __future__ import annotations

import json
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import msgspec
import openai
import pytest

from foretoken.adapters.engines.engines_file import dump_engines, load_engines
from foretoken.adapters.processes import foretoken_cmd, spawn, stop, wait_http
from foretoken.settings import Settings
from tests.conftest import free_port

pytestmark = pytest.mark.integration


def _openai(url: str, key: str = "k") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def _anthropic(url: str, key: str = "k") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)


# ---------------------------------------------------------------------------- simulated fleet


@pytest.fixture(scope="module")
def fleet_router(
    kafka_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, Path]]:
    """The small simulated fleet and a router deciding alone (no route service): the
    fallback sends sequential requests to the same idle engine, so a prompt sent twice hits
    its prefix cache."""
    tmp = tmp_path_factory.mktemp("sim")
    env = {"FORETOKEN_TOPIC_PREFIX": kafka_settings.topic_prefix,
           "KAFKA_BOOTSTRAP_SERVERS": kafka_settings.kafka.bootstrap_servers}  # fmt: skip
    engines_file = tmp / "engines.toml"
    fleet = spawn(foretoken_cmd("fleet", "run", "small", "--base-port", "0", "--kv-base-port",
                                "0", "--engines-out", str(engines_file)), env,
                  tmp / "fleet.log")  # fmt: skip
    router = None
    try:
        deadline = time.monotonic() + 60
        while not engines_file.exists():
            assert fleet.poll() is None and time.monotonic() < deadline, "no fleet"
            time.sleep(0.1)
        model = tomllib.loads(engines_file.read_text())["engines"][0]["model"]
        port = free_port()
        router = spawn(foretoken_cmd("router", "-e", str(engines_file), "--port", str(port)),
                       {**env, "FORETOKEN_ROUTE_URL": f"http://127.0.0.1:{free_port()}"},
                       tmp / "router.log")  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/healthz", 60, router)
        yield url, model, engines_file
    finally:
        if router is not None:
            stop(router)
        stop(fleet)


def test_the_sdks_against_the_simulated_fleet(fleet_router: tuple[str, str, Path]) -> None:
    url, model, _ = fleet_router
    c = _openai(url)
    messages: Any = [{"role": "system", "content": "word " * 300},
                     {"role": "user", "content": "hi"}]  # fmt: skip
    first = c.chat.completions.create(model=model, messages=messages, max_tokens=2)
    details = first.usage.prompt_tokens_details if first.usage else None
    assert details is not None and details.cached_tokens == 0  # a miss says 0
    again = list(c.chat.completions.create(
        model=model, messages=messages, max_tokens=2, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    usage = again[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) > 0  # the same engine's cache
    assert again[0].choices[0].delta.role == "assistant"
    assert c.completions.create(model=model, prompt=[[5, 6, 7, 8]], max_tokens=2).choices
    counted = httpx.post(url + "/tokenize", json={"model": model, "prompt": "word " * 300},
                         timeout=30).json()  # an engine's own count, passed through  # fmt: skip
    assert counted["count"] == 300 and len(counted["tokens"]) == 300
    batch = c.completions.create(model=model, prompt=["word " * 300, [5, 6, 7, 8]], max_tokens=2)
    assert [ch.index for ch in batch.choices] == [0, 1] and batch.usage is not None
    assert batch.usage.completion_tokens == 4 and batch.usage.prompt_tokens > 300
    a = _anthropic(url)
    m = a.messages.create(model=model, max_tokens=2, system=messages[0]["content"],
                          messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    assert m.usage.output_tokens == 2 and (m.usage.cache_read_input_tokens or 0) > 0
    with a.messages.stream(model=model, max_tokens=3,
                           messages=[{"role": "user", "content": "hello"}]) as s:  # fmt: skip
        assert len(list(s.text_stream)) == 3
        assert s.get_final_message().usage.output_tokens == 3
    counted = a.messages.count_tokens(model=model, system=messages[0]["content"],
                                      messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    # what was routed is what is counted; Anthropic's input_tokens are the uncached ones
    cache_read = m.usage.cache_read_input_tokens or 0
    assert counted.input_tokens == m.usage.input_tokens + cache_read


def test_sglang_native_generate_is_routed_and_measured(
    fleet_router: tuple[str, str, Path], kafka_settings: Settings, tmp_path: Path
) -> None:
    """SGLang's /generate (as sglang.bench_serving sends it): routed to an SGLang engine,
    streamed as the engine streams it or answered whole, its counts in the outcome; an
    engine that is not SGLang's, a batch, no prompt: a 400 that says so."""
    url, model, engines_file = fleet_router
    vllm = httpx.post(url + "/generate", json={"text": "hi"}, timeout=30)
    assert vllm.status_code == 400 and "/v1/completions" in vllm.json()["error"]["message"]
    sglang = tmp_path / "sglang.toml"
    sglang.write_text(dump_engines([msgspec.structs.replace(e, engine="sglang")
                                    for e in load_engines(engines_file)]))  # fmt: skip
    env = {"FORETOKEN_TOPIC_PREFIX": kafka_settings.topic_prefix,
           "KAFKA_BOOTSTRAP_SERVERS": kafka_settings.kafka.bootstrap_servers,
           "FORETOKEN_ROUTE_URL": f"http://127.0.0.1:{free_port()}"}  # fmt: skip
    port = free_port()
    router = spawn(foretoken_cmd("router", "-e", str(sglang), "--port", str(port)), env,
                   tmp_path / "router.log")  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/healthz", 60, router)
        prompt = "word " * 200
        whole = httpx.post(base + "/generate", timeout=30, json={
            "text": prompt, "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "rid": "abc"})  # fmt: skip
        assert whole.status_code == 200, whole.text
        doc = whole.json()
        assert len(doc["output_ids"]) == 3 and doc["text"].count(" t") == 3
        assert doc["meta_info"]["completion_tokens"] == 3
        assert doc["meta_info"]["finish_reason"]["type"] == "length"
        events = []
        with httpx.stream("POST", base + "/generate", timeout=30, json={
            "input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4},
            "stream": True, "model": model, "max_queue_wait_s": 30}) as resp:  # fmt: skip
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                elif line == "data: [DONE]":
                    events.append("DONE")
        assert events[-1] == "DONE" and events[-2]["meta_info"]["completion_tokens"] == 4
        assert [len(e["output_ids"]) for e in events[:4]] == [1, 2, 3, 4]  # cumulative
        again = httpx.post(base + "/generate", timeout=30, json={
            "text": prompt, "sampling_params": {"max_new_tokens": 1}}).json()  # fmt: skip
        assert again["meta_info"]["cached_tokens"] > 0  # the same engine: its prefix cache
        for body, param in (({"text": ["a", "b"]}, "text"), ({"input_ids": [[1], [2]]},
                            "input_ids"), ({"sampling_params": {}}, "text"),
                            ({"text": "a", "sampling_params": {"max_new_tokens": -1}},
                             "sampling_params.max_new_tokens")):  # fmt: skip
            bad = httpx.post(base + "/generate", json=body, timeout=30)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
        metrics = httpx.get(base + "/metrics", timeout=30).text
        assert 'foretoken_router_requests_total{outcome="ok"} 3.0' in metrics
    finally:
        stop(router)
