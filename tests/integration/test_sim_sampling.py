"""``n``, ``logprobs`` and ``echo`` through the official openai SDK against ``foretoken
fleet run small`` as a real process: an engine asked directly, and the same fleet behind a
real router (deciding alone, no route service) that streams from the engine and assembles
whole answers itself — so ``n = 2`` gives two choices, logprobs have OpenAI's shape and the
prompt is echoed either way."""

from __future__ import annotations

import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from foretoken.adapters.processes import foretoken_cmd, spawn, stop, wait_http
from foretoken.settings import Settings
from tests.conftest import free_port

pytestmark = pytest.mark.integration
START_S = 60.0
MSG: Any = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def stack(
    kafka_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[str, str]]]:
    """{"engine": (url, model), "router": (url, model)}."""
    tmp = tmp_path_factory.mktemp("sampling")
    env = {"FORETOKEN_TOPIC_PREFIX": kafka_settings.topic_prefix,
           "KAFKA_BOOTSTRAP_SERVERS": kafka_settings.kafka.bootstrap_servers}  # fmt: skip
    out = tmp / "engines.toml"
    args = ["fleet", "run", "small", "--base-port", "0", "--kv-base-port", "0",
            "--engines-out", str(out)]  # fmt: skip
    fleet = spawn(foretoken_cmd(*args), env, tmp / "fleet.log")
    router = None
    try:
        deadline = time.monotonic() + START_S
        while not out.exists():
            assert fleet.poll() is None and time.monotonic() < deadline, "no fleet"
            time.sleep(0.1)
        first = tomllib.loads(out.read_text())["engines"][0]
        wait_http(first["http_url"] + "/healthz", START_S, fleet)
        port = free_port()
        router = spawn(foretoken_cmd("router", "-e", str(out), "--port", str(port)),
                       {**env, "FORETOKEN_ROUTE_URL": f"http://127.0.0.1:{free_port()}"},
                       tmp / "router.log")  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/healthz", START_S, router)
        yield {"engine": (first["http_url"], first["model"]), "router": (url, first["model"])}
    finally:
        if router is not None:
            stop(router)
        stop(fleet)
    assert "Traceback" not in Path(tmp / "router.log").read_text()


@pytest.fixture(params=["engine", "router"])
def target(request: pytest.FixtureRequest, stack: dict[str, tuple[str, str]]) -> tuple[Any, str]:
    url, model = stack[request.param]
    return openai.OpenAI(base_url=url + "/v1", api_key="sim", max_retries=0), model


def test_n_choices_whole_and_streamed(target: tuple[openai.OpenAI, str]) -> None:
    c, model = target
    chat = c.chat.completions.create(model=model, messages=MSG, max_tokens=3, n=2)
    assert [ch.index for ch in chat.choices] == [0, 1]
    assert chat.choices[0].message.content != chat.choices[1].message.content
    assert all(ch.finish_reason == "length" for ch in chat.choices)
    assert chat.usage is not None and chat.usage.completion_tokens == 6
    text = c.completions.create(model=model, prompt="hello", max_tokens=2, n=2)
    assert [ch.index for ch in text.choices] == [0, 1] and all(ch.text for ch in text.choices)
    usage_on: Any = {"include_usage": True}
    stream = c.chat.completions.create(
        model=model, messages=MSG, max_tokens=3, n=2, stream=True, stream_options=usage_on
    )
    seen: dict[int, list[Any]] = {}
    usage = None
    for chunk in stream:
        for ch in chunk.choices:
            seen.setdefault(ch.index, []).append(ch)
        usage = chunk.usage or usage
    assert sorted(seen) == [0, 1] and usage is not None and usage.completion_tokens == 6
    for events in seen.values():
        assert events[0].delta.role == "assistant" and events[-1].finish_reason == "length"
        assert len([e for e in events if e.delta.content]) == 3
    texts = c.completions.create(model=model, prompt="hello", max_tokens=2, n=2, stream=True)
    indexes = [ch.index for chunk in texts for ch in chunk.choices if ch.text]
    assert sorted(indexes) == [0, 0, 1, 1]


def test_logprobs(target: tuple[openai.OpenAI, str]) -> None:
    c, model = target
    text = c.completions.create(model=model, prompt="hello", max_tokens=3, logprobs=2)
    lp = text.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 3
    assert "".join(lp.tokens) == text.choices[0].text
    assert lp.top_logprobs is not None and all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.token_logprobs is not None and all(v is not None and v < 0 for v in lp.token_logprobs)
    assert lp.text_offset is not None and len(lp.text_offset) == 3
    chat = c.chat.completions.create(model=model, messages=MSG, max_tokens=2, n=2,
                                     logprobs=True, top_logprobs=3)  # fmt: skip
    for choice in chat.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert len(choice.logprobs.content) == 2
        for e in choice.logprobs.content:
            assert e.logprob < 0 and e.bytes == list(e.token.encode())
            assert [t.token for t in e.top_logprobs][:1] == [e.token] and len(e.top_logprobs) == 3


def test_echo(target: tuple[openai.OpenAI, str]) -> None:
    c, model = target
    prompt = "Once upon a time"
    reply = c.completions.create(model=model, prompt=prompt, max_tokens=2, n=2, echo=True,
                                 logprobs=0)  # fmt: skip
    for choice in reply.choices:
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
        lp = choice.logprobs
        assert lp is not None and lp.tokens is not None and "".join(lp.tokens) == choice.text
        assert lp.token_logprobs is not None and lp.token_logprobs[0] is None
    streamed = c.completions.create(model=model, prompt=prompt, max_tokens=2, echo=True,
                                    stream=True)  # fmt: skip
    assert "".join(ch.text for chunk in streamed for ch in chunk.choices).startswith(prompt)
    ids = c.completions.create(model=model, prompt=[30, 31], max_tokens=1, echo=True)
    assert ids.choices[0].text.startswith(" t30 t31")


def test_refusals_reach_the_client(target: tuple[openai.OpenAI, str]) -> None:
    c, model = target
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        c.completions.create(model=model, prompt="x", max_tokens=1, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="echo"):
        c.chat.completions.create(model=model, messages=MSG, max_tokens=1, extra_body={
            "echo": True})  # fmt: skip
