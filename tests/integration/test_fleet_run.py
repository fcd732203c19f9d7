"""`foretoken fleet run small.toml` as a real process: the official openai client streams
from an engine, a real ZMQ subscriber decodes its KV events in vLLM's format, and a repeated
prefix is reported as cached tokens."""

from __future__ import annotations

import time
import tomllib
from collections.abc import Iterator

import openai
import pytest
import zmq

from foretoken.adapters.engines.decoders import decode_vllm_frames
from foretoken.adapters.processes import foretoken_cmd, spawn, stop, wait_http
from foretoken.wire.records import BlockStored

pytestmark = pytest.mark.integration
START_S = 60.0


@pytest.fixture(scope="module")
def fleet_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict]]:
    tmp = tmp_path_factory.mktemp("fleet")
    out = tmp / "engines.toml"
    args = ["fleet", "run", "small", "--base-port", "0", "--kv-base-port", "0",
            "--no-register", "--engines-out", str(out), "--time-scale", "0.5"]  # fmt: skip
    proc = spawn(foretoken_cmd(*args), {}, tmp / "fleet.log")
    try:
        deadline = time.monotonic() + START_S
        while not out.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        engines = tomllib.loads(out.read_text())["engines"]
        for e in engines:
            wait_http(e["http_url"] + "/healthz", START_S, proc)
        yield engines
    finally:
        stop(proc)


def test_streaming_first_token_kv_events_and_cached_tokens(fleet_engines: list[dict]) -> None:
    engine = fleet_engines[0]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(engine["kv_events_url"])
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.3)  # let the subscription reach the publisher
    client = openai.OpenAI(base_url=engine["http_url"] + "/v1", api_key="sim", max_retries=0)
    prompt = list(range(1000, 1000 + 40 * engine["block_size"] + 5))
    cached: list[int | None] = []
    for _ in range(2):
        stream = client.completions.create(
            model=engine["model"], prompt=prompt, max_tokens=4, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        texts, usage = [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                texts.append(chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage
        assert len(texts) == 4  # the first token arrived, then the rest
        assert usage is not None and usage.prompt_tokens == len(prompt)
        details = usage.prompt_tokens_details
        cached.append(details.cached_tokens if details else None)
    assert cached[0] is None  # a miss: vLLM omits the field
    assert cached[1] == 40 * engine["block_size"]  # every full block of the prompt, reused

    stored = []
    while sub.poll(1000):
        decoded = decode_vllm_frames(
            sub.recv_multipart(), worker_id=engine["worker_id"], model=engine["model"],
            default_block_size=engine["block_size"],
        )  # fmt: skip
        stored += [e for e in decoded.batch.events if isinstance(e, BlockStored)]
    sub.close(0)
    hashes = [h for e in stored for h in e.block_hashes]
    assert len(hashes) == 40 and len(set(hashes)) == 40
    assert [t for e in stored for t in e.token_id_list()] == prompt[: 40 * engine["block_size"]]


def test_non_streaming_chat_and_errors(fleet_engines: list[dict]) -> None:
    engine = fleet_engines[1]
    client = openai.OpenAI(base_url=engine["http_url"] + "/v1", api_key="sim", max_retries=0)
    reply = client.chat.completions.create(
        model=engine["model"], messages=[{"role": "user", "content": "hello " * 50}], max_tokens=3
    )
    assert reply.choices[0].message.content and reply.usage and reply.usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=engine["model"], prompt="", max_tokens=1)
    models = client.models.list()
    assert [m.id for m in models.data] == [engine["model"]]
