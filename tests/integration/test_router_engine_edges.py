"""What the router does when the engine or the client misbehaves, end to end (real router
process, real broker, the stub engine's markers): a client that goes away cancels the
engine's request, streamed or not; ``router.engine_timeout_s`` cuts a silent engine but never
a long healthy stream; an engine's own 429 keeps its ``Retry-After``; SSE with CRLF line
ends; one ``x-request-id`` on many requests; the Anthropic surface's small contracts (HEAD,
``request_id`` in error bodies, the temperature range)."""

from __future__ import annotations

import json
import re
import socket
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from foretoken.settings import Settings
from tests.integration.stub_router import MODEL, StubRouter, stub_engines, stub_router

pytestmark = pytest.mark.integration
IDLE_S = 1.5


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with stub_engines(tmp_path_factory.mktemp("stub")) as path:
        yield path


@pytest.fixture(scope="module")
def router(
    kafka_settings: Settings, tmp_path_factory: pytest.TempPathFactory, engines: Path
) -> Iterator[StubRouter]:
    with stub_router(kafka_settings, tmp_path_factory.mktemp("router"), engines,
                     FORETOKEN__ROUTER__ENGINE_TIMEOUT_S=str(IDLE_S),
                     FORETOKEN__ROUTER__CORS_ORIGINS="https://ui.example") as r:  # fmt: skip
        yield r
    assert "Traceback" not in r.log_text()


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def aborted(engines_file: Path) -> float:
    """Requests the stub engines saw abandoned by their client (the router)."""
    urls = [e["http_url"] for e in tomllib.loads(engines_file.read_text())["engines"]]
    return sum(_metric(_get(u + "/metrics"), "foretoken_stub_aborted_total") for u in urls)


def cancelled(r: StubRouter) -> float:
    return _metric(_get(r.url + "/metrics"), 'foretoken_router_requests_total{outcome="cancelled"}')


def wait_for(check: object, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _send_and_hang_up(r: StubRouter, body: dict[str, object], after_s: float) -> None:
    port = int(r.url.rsplit(":", 1)[1])
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        sock.sendall(head + b"\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        time.sleep(after_s)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_cancels_the_engine_request(
    router: StubRouter, engines: Path, stream: bool
) -> None:
    """Before: a non-streaming request ran to its end on the engine for nobody (aiohttp does
    not cancel a handler whose client left) and was counted ok."""
    before_aborted, before_cancelled = aborted(engines), cancelled(router)
    message = [{"role": "user", "content": "__stub_stall__"}]
    _send_and_hang_up(router, {"model": MODEL, "messages": message, "max_tokens": 4,
                               "stream": stream}, after_s=0.3)  # fmt: skip
    wait_for(
        lambda: aborted(engines) > before_aborted,
        "the engine's request to be closed",
        timeout_s=IDLE_S * 0.9,
    )  # fmt: skip (sooner than the idle timeout would)
    wait_for(lambda: cancelled(router) > before_cancelled, "the router to count it cancelled")


def test_a_long_healthy_stream_is_not_cut_by_the_engine_timeout(router: StubRouter) -> None:
    """8 tokens 0.5 s apart (3.5 s, over twice the timeout): the timeout is for silence. Before:
    a total timeout cut every answer longer than it, and a non-streamed one came back a 502
    that the SDKs retried."""
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
    started = time.monotonic()
    whole = client.completions.create(model=MODEL, prompt="__stub_slow__", max_tokens=8)
    assert whole.choices[0].text == " tok" * 8 and time.monotonic() - started > 2 * IDLE_S
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=8, stream=True,
        messages=[{"role": "user", "content": "__stub_slow__"}],
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == " tok" * 8


def test_a_silent_engine_is_cut_after_the_engine_timeout(router: StubRouter) -> None:
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError, match="engine_timeout_s") as info:
        client.completions.create(model=MODEL, prompt="__stub_stall__", max_tokens=4)
    assert info.value.status_code == 504
    assert IDLE_S <= time.monotonic() - started < IDLE_S + 5
    stream = client.completions.create(model=MODEL, prompt="__stub_stall__", max_tokens=4,
                                       stream=True)  # fmt: skip
    with pytest.raises(openai.APIError, match="sent nothing for"):
        list(stream)


def test_an_engines_own_429_keeps_its_retry_after(router: StubRouter) -> None:
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.RateLimitError, match="stub is overloaded") as info:
        client.completions.create(model=MODEL, prompt="__stub_429__", max_tokens=1)
    assert info.value.response.headers["retry-after"] == "7"
    claude = anthropic.Anthropic(base_url=router.url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as refused:
        claude.messages.create(model=MODEL, max_tokens=1,
                               messages=[{"role": "user", "content": "__stub_429__"}])  # fmt: skip
    assert refused.value.response.headers["retry-after"] == "7"


def test_an_sse_stream_with_crlf_line_ends(router: StubRouter) -> None:
    """Before: events were split on LF LF only: "engine stream ended without [DONE]"."""
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
    whole = client.completions.create(model=MODEL, prompt="__stub_crlf__", max_tokens=2)
    assert whole.choices[0].text == " tok tok"
    stream = client.completions.create(model=MODEL, prompt="__stub_crlf__", max_tokens=2,
                                       stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in stream if c.choices) == " tok tok"


def test_one_request_id_on_many_requests_is_one_request_each(router: StubRouter) -> None:
    """A client (or a proxy) that sends one x-request-id for every request: each one gets
    its own id (the client's, then ``~2``, ``~3``), never a 409 or another's decision."""
    ids = []
    for prompt in ("one", "two words", "three words here"):
        req = urllib.request.Request(
            router.url + "/v1/completions", method="POST",
            data=json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode(),
            headers={"Content-Type": "application/json", "x-request-id": "fixed-id-7"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
            ids.append(resp.headers["x-request-id"])
    assert ids == ["fixed-id-7", "fixed-id-7~2", "fixed-id-7~3"]


def test_the_anthropic_surfaces_small_contracts(router: StubRouter) -> None:
    head = urllib.request.Request(router.url + "/health", method="HEAD")
    with urllib.request.urlopen(head, timeout=10) as resp:  # a load balancer's probe
        assert resp.status == 200
    claude = anthropic.Anthropic(base_url=router.url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="temperature") as info:
        claude.messages.create(model=MODEL, max_tokens=1, extra_body={"temperature": 1.5},
                               messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    body = info.value.body
    assert isinstance(body, dict) and body["request_id"]
    assert body["request_id"] == info.value.response.headers["request-id"]


def test_a_browser_client_gets_cors_from_an_allowed_origin_only(router: StubRouter) -> None:
    """Web UIs call vLLM from the browser (its server allows CORS); through the router a
    preflight was a 405. Allowed origins are configured (router.cors_origins)."""
    preflight = urllib.request.Request(router.url + "/v1/chat/completions", method="OPTIONS",
                                       headers={"Origin": "https://ui.example",
                                                "Access-Control-Request-Method": "POST",
                                                "Access-Control-Request-Headers":
                                                    "authorization, content-type"})  # fmt: skip
    with urllib.request.urlopen(preflight, timeout=10) as resp:
        assert resp.status == 204
        assert resp.headers["Access-Control-Allow-Origin"] == "https://ui.example"
        assert "authorization" in resp.headers["Access-Control-Allow-Headers"]
    for origin, allowed in (("https://ui.example", True), ("https://evil.example", False)):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "stream": True}
        req = urllib.request.Request(router.url + "/v1/completions", method="POST",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Origin": origin})  # fmt: skip
        with urllib.request.urlopen(req, timeout=10) as resp:  # a stream: headers go first
            assert (resp.headers.get("Access-Control-Allow-Origin") == origin) is allowed
            assert (
                "x-request-id" in resp.headers.get("Access-Control-Expose-Headers", "")
            ) is allowed
            resp.read()


def test_the_model_list_has_what_vllm_bench_reads(router: StubRouter) -> None:
    """``vllm bench serve`` without --model reads ``data[0]["root"]`` (a KeyError before)."""
    listing = json.loads(_get(router.url + "/v1/models"))
    assert listing["data"][0]["root"] == MODEL and listing["data"][0]["parent"] is None


def test_a_dead_engine_gets_no_more_requests_once_it_failed(
    kafka_settings: Settings, engines: Path, tmp_path: Path
) -> None:
    """A dead engine looks idle, and least-outstanding (the fallback, as here) or a
    predictor sends it work: after its first refused connection the router sends the next
    requests to the live engine (engine_down_s), so a client sees one 502, not one in two."""
    from tests.conftest import free_port

    live = tomllib.loads(engines.read_text())["engines"][0]
    both = tmp_path / "engines.toml"
    both.write_text(f'[[engines]]\nworker_id = "gone"\nmodel = "{MODEL}"\n'
                    f'http_url = "http://127.0.0.1:{free_port()}"\n'
                    f'[[engines]]\nworker_id = "live"\nmodel = "{MODEL}"\n'
                    f'http_url = "{live["http_url"]}"\n')  # fmt: skip
    with stub_router(kafka_settings, tmp_path, both,
                     FORETOKEN__ROUTER__ENGINE_DOWN_S="60") as r:  # fmt: skip
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="k", max_retries=0)
        failures = 0
        for _ in range(8):
            try:
                client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
            except openai.InternalServerError:
                failures += 1
        # the first request goes to the dead one (idle, first in the file), none after it
        assert failures == 1
    assert "Traceback" not in r.log_text()


def test_an_engine_that_does_not_answer_is_a_502_in_each_apis_shape(
    kafka_settings: Settings, tmp_path: Path
) -> None:
    """An engine that refuses the connection: every API, streamed or not, gets a 502 in its
    own error shape before any byte of a stream (before: a streamed request got a 200 with
    an empty body, which the SDKs read as a stream that ended without an answer)."""
    from tests.conftest import free_port

    dead = tmp_path / "engines.toml"
    dead.write_text(f'[[engines]]\nworker_id = "gone"\nmodel = "{MODEL}"\n'
                    f'http_url = "http://127.0.0.1:{free_port()}"\n')  # fmt: skip
    with stub_router(kafka_settings, tmp_path, dead) as r:
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="k", max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError, match="engine unreachable") as info:
                out = client.chat.completions.create(
                    model=MODEL, max_tokens=2, stream=stream,
                    messages=[{"role": "user", "content": "hi"}])  # fmt: skip
                list(out) if stream else None  # type: ignore[call-overload]
            assert info.value.status_code == 502
            with pytest.raises(openai.InternalServerError):
                resp = client.responses.create(model=MODEL, input="hi", stream=stream)
                list(resp) if stream else None  # type: ignore[call-overload]
            a = anthropic.Anthropic(base_url=r.url, api_key="k", max_retries=0)
            with pytest.raises(anthropic.InternalServerError) as err:
                msg = a.messages.create(model=MODEL, max_tokens=2, stream=stream,
                                        messages=[{"role": "user", "content": "hi"}])  # fmt: skip
                list(msg) if stream else None  # type: ignore[call-overload]
            assert err.value.status_code == 502
    assert "Traceback" not in r.log_text()
