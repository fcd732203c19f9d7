"""A near-zero-cost engine for measuring the router: ``python -m foretoken.bench.engine_stub``.

It answers ``POST /v1/completions`` and ``/v1/chat/completions`` with an OpenAI stream of
``--tokens`` tokens (``max_tokens`` when the body names a smaller one): the first after
``--ttft-ms``, the next every ``--itl-ms``, then the finish chunk, the usage chunk when asked
for, and ``[DONE]``; or, without ``"stream": true``, one JSON answer after the same time.
No model, no tokenizer, no JSON parsing: the chunks are pre-encoded bytes written from timer
callbacks of a uvloop loop, on a bare asyncio protocol (HTTP/1.1 keep-alive, chunked), so
one process serves several ports (one per fake engine) at a fraction of a core. Also
``GET /health``, ``/healthz``, ``/v1/models``, ``/metrics``; a ``POST`` to any other path
(embeddings, tokenize, …) is answered with what it got: its path, the port, the body.

For the tests, a body holding one of these markers changes the answer: ``__stub_refuse__``
(a 400 with an OpenAI error body), ``__stub_error_event__`` (an SSE error event after the first
token, then ``[DONE]``), ``__stub_break__`` (the connection dropped after the first token),
``__stub_echo_headers__`` (the first token's text is the request's headers as JSON),
``__stub_echo_body__`` (one token per choice of ``n``, choice 0's text the body as received),
``__stub_reasoning__`` (a chat answer: two pieces of ``reasoning_content``, then a text),
``__stub_crlf__`` (the stream's lines end in CRLF), ``__stub_429__`` (a 429 with
``Retry-After: 7``), ``__stub_slow__`` (8 tokens 0.5 s apart), ``__stub_stall__`` (one token,
then silence). ``/metrics`` counts the requests served and the ones whose connection the
client closed before the answer was complete (``aborted``: what a real engine aborts).

``--engines-out FILE`` writes the engines file the router, ingest and the bench use (KV
events off: the route service credits the cache approximately).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Final

HEAD_END: Final = b"\r\n\r\n"
MAX_HEAD: Final = 65_536
_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.I)
_MAX_TOKENS = re.compile(rb'"max_(?:completion_)?tokens"\s*:\s*(\d+)')
_STREAM = re.compile(rb'"stream"\s*:\s*true')
_USAGE = re.compile(rb'"include_usage"\s*:\s*true')
_N = re.compile(rb'"n"\s*:\s*(\d+)')


def head_lines(line: list[bytes], head: bytes) -> dict[str, str]:
    """The request's headers, lower-cased names (only for ``__stub_echo_headers__``)."""
    out = {}
    for raw in head.split(b"\r\n")[1:]:
        name, _, value = raw.decode("latin-1").partition(":")
        out[name.strip().lower()] = value.strip()
    return out


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Answers:
    """Every byte string the stub sends, built once."""

    def __init__(self, model: str) -> None:
        m = model.encode()
        head = b'{"id":"cmpl-stub","created":0,"model":"' + m + b'",'
        self.text = _chunk(b"data: " + head + b'"object":"text_completion","choices":[{"index":0,'
                           b'"text":" tok","finish_reason":null}]}\n\n')  # fmt: skip
        self.chat = _chunk(b"data: " + head + b'"object":"chat.completion.chunk","choices":[{'
                           b'"index":0,"delta":{"content":" tok"},'
                           b'"finish_reason":null}]}\n\n')  # fmt: skip
        self.role = _chunk(b"data: " + head + b'"object":"chat.completion.chunk","choices":[{'
                           b'"index":0,"delta":{"role":"assistant","content":""},'
                           b'"finish_reason":null}]}\n\n')  # fmt: skip
        self.text_end = _chunk(b"data: " + head + b'"object":"text_completion","choices":[{'
                               b'"index":0,"text":"","finish_reason":"length"}]}\n\n')  # fmt: skip
        self.chat_end = _chunk(b"data: " + head + b'"object":"chat.completion.chunk","choices":[{'
                               b'"index":0,"delta":{},"finish_reason":"length"}]}\n\n')  # fmt: skip
        self.head = head
        self.done = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        self.stream_head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                            b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip

    def usage(self, n: int, chat: bool) -> bytes:
        kind = b"chat.completion.chunk" if chat else b"text_completion"
        return _chunk(b"data: " + self.head + b'"object":"' + kind + b'","choices":[],'
                      b'"usage":{"prompt_tokens":0,"completion_tokens":%d,"total_tokens":%d}}\n\n'
                      % (n, n))  # fmt: skip

    def whole(self, chat: bool, n: int) -> bytes:
        text = b" tok" * n
        choice = (b'"message":{"role":"assistant","content":"' + text + b'"}' if chat
                  else b'"text":"' + text + b'"')  # fmt: skip
        body = (self.head + b'"object":"' + (b"chat.completion" if chat else b"text_completion")
                + b'","choices":[{"index":0,' + choice + b',"finish_reason":"length"}],'
                b'"usage":{"prompt_tokens":0,"completion_tokens":%d,"total_tokens":%d}}'
                % (n, n))  # fmt: skip
        return json_response(200, body)


def json_response(status: int, body: bytes) -> bytes:
    reasons = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 429: b"Too Many Requests"}
    reason = reasons.get(status, b"OK")
    return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (status, reason, len(body), body))  # fmt: skip


class StubProtocol(asyncio.Protocol):
    def __init__(self, engine: StubEngine) -> None:
        self.engine = engine
        self.buffer = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.head = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.busy:
            self.engine.aborted += 1

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._next()

    def _next(self) -> None:
        while not self.busy and self.transport is not None:
            end = self.buffer.find(HEAD_END)
            if end < 0:
                if len(self.buffer) > MAX_HEAD:
                    self.transport.close()
                return
            head = self.buffer[:end]
            self.head = head
            m = _LENGTH.search(head)
            length = int(m.group(1)) if m else 0
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4 : end + 4 + length]
            self.buffer = self.buffer[end + 4 + length :]
            self._answer(head.split(b" ", 2), body)

    def _answer(self, line: list[bytes], body: bytes) -> None:
        assert self.transport is not None
        method, path = line[0], line[1] if len(line) > 1 else b"/"
        e = self.engine
        if method == b"POST" and path in (b"/v1/completions", b"/v1/chat/completions"):
            chat = path == b"/v1/chat/completions"
            if b"__stub_" in body and self._special(head_lines(line, self.head), body, chat):
                return
            m = _MAX_TOKENS.search(body)
            n = min(e.tokens, int(m.group(1))) if m else e.tokens
            if _STREAM.search(body):
                self.busy = True
                self.transport.write(e.answers.stream_head + (e.answers.role if chat else b""))
                usage = _USAGE.search(body) is not None
                e.loop.call_later(e.ttft_s, self._token, chat, n, n, usage)
            else:
                self.busy = True
                e.loop.call_later(e.ttft_s + e.itl_s * (n - 1), self._whole, chat, n)
            return
        if method == b"GET" and path in (b"/health", b"/healthz"):
            self.transport.write(json_response(200, b'{"status":"ok"}'))
        elif method == b"GET" and path == b"/v1/models":
            listing = b'{"object":"list","data":[{"id":"%s","object":"model"}]}' % e.model.encode()
            self.transport.write(json_response(200, listing))
        elif method == b"POST":  # another engine endpoint (embeddings, tokenize, …): what
            # it got, and from which engine (the router passes these through untouched)
            status = 400 if b"__stub_refuse__" in body else 200
            doc = {"stub_path": path.decode(errors="replace"), "stub_port": e.port,
                   "stub_body": body.decode(errors="replace")}  # fmt: skip
            self.transport.write(json_response(status, json.dumps(doc).encode()))
        elif method == b"GET" and path == b"/metrics":
            self.transport.write(json_response(200, b"foretoken_stub_requests_total %d\n"
                                               b"foretoken_stub_aborted_total %d\n"
                                               % (e.served, e.aborted)))  # fmt: skip
        else:
            self.transport.write(json_response(404, b'{"error":{"message":"not found"}}'))

    def _special(self, headers: dict[str, str], body: bytes, chat: bool) -> bool:
        """The test markers (see the module's docstring); False: none of them."""
        assert self.transport is not None
        e = self.engine
        if b"__stub_refuse__" in body:
            err = b'{"error":{"message":"stub refuses: prompt too long","type":"BadRequestError",'
            self.transport.write(json_response(400, err + b'"param":null,"code":400}}'))
            return True
        one = e.answers.chat if chat else e.answers.text
        if b"__stub_echo_headers__" in body:
            text = json.dumps(json.dumps(headers))[1:-1].encode()
            one = one.replace(b" tok", text, 1)
            one = _chunk(one.split(b"\r\n", 1)[1].rsplit(b"\r\n", 1)[0])
            tail = (e.answers.chat_end if chat else e.answers.text_end) + e.answers.done
            self.transport.write(e.answers.stream_head + one + tail)
            return True
        if b"__stub_echo_body__" in body:
            self.transport.write(e.answers.stream_head + _echo_body(body, chat, e.model)
                                 + e.answers.done)  # fmt: skip
            return True
        if b"__stub_reasoning__" in body and chat:  # a reasoning model's answer
            said = [_delta(e.model, {"role": "assistant", "reasoning_content": "Let me think."}),
                    _delta(e.model, {"reasoning_content": " Done."}),
                    _delta(e.model, {"content": "Answer."}),
                    _delta(e.model, {}, finish="stop")]  # fmt: skip
            self.transport.write(e.answers.stream_head + b"".join(said) + e.answers.usage(3, chat)
                                 + e.answers.done)  # fmt: skip
            return True
        if b"__stub_error_event__" in body:
            err = _chunk(b'data: {"error":{"message":"stub failed mid-stream",'
                         b'"type":"InternalError","code":500}}\n\n')  # fmt: skip
            self.transport.write(e.answers.stream_head + one + err + e.answers.done)
            return True
        if b"__stub_break__" in body:
            self.transport.write(e.answers.stream_head + one)
            self.transport.close()
            return True
        if b"__stub_crlf__" in body:
            tail = (e.answers.chat_end if chat else e.answers.text_end) + e.answers.done
            events = [_unchunk(part) for part in (one, one, tail)]
            crlf = b"".join(ev.replace(b"\n", b"\r\n") for ev in events if ev)
            self.transport.write(e.answers.stream_head + _chunk(crlf) + b"0\r\n\r\n")
            return True
        if b"__stub_429__" in body:
            err = b'{"error":{"message":"stub is overloaded","type":"RateLimitError","code":429}}'
            answer = json_response(429, err).replace(b"\r\n", b"\r\nRetry-After: 7\r\n", 1)
            self.transport.write(answer)
            return True
        if b"__stub_slow__" in body or b"__stub_stall__" in body:
            self.busy = True
            self.transport.write(e.answers.stream_head + (e.answers.role if chat else b""))
            if b"__stub_slow__" in body:
                e.loop.call_later(0.0, self._token, chat, 8, 8, False, 0.5)
            else:  # one token, then nothing until the client closes
                self.transport.write(one)
            return True
        return False

    def _token(self, chat: bool, left: int, n: int, usage: bool,
               gap_s: float | None = None) -> None:  # fmt: skip
        """The next token ``gap_s`` (default ``--itl-ms``) after this one; then the end."""
        t, e = self.transport, self.engine
        if t is None or t.is_closing():
            self._free()
            return
        if left > 0:
            t.write(e.answers.chat if chat else e.answers.text)
            if left > 1:
                gap = e.itl_s if gap_s is None else gap_s
                e.loop.call_later(gap, self._token, chat, left - 1, n, usage, gap_s)
                return
        tail = e.answers.chat_end if chat else e.answers.text_end
        t.write(tail + (e.answers.usage(n, chat) if usage else b"") + e.answers.done)
        e.served += 1
        self._free()

    def _whole(self, chat: bool, n: int) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self.engine.answers.whole(chat, n))
            self.engine.served += 1
        self._free()

    def _free(self) -> None:
        self.busy = False
        self.head = b""
        if self.buffer:
            self._next()


def _unchunk(data: bytes) -> bytes:
    """The bytes of chunked-encoded pieces (the pre-encoded answers), without the framing."""
    out, rest = b"", data
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2 :]
    return out


def _delta(model: str, fields: dict[str, str], finish: str | None = None) -> bytes:
    """One chat completion event of choice 0 saying ``fields``."""
    doc = {"id": "cmpl-stub", "created": 0, "model": model, "object": "chat.completion.chunk",
           "choices": [{"index": 0, "delta": fields, "finish_reason": finish}]}  # fmt: skip
    return _chunk(b"data: " + json.dumps(doc).encode() + b"\n\n")


def _echo_body(body: bytes, chat: bool, model: str) -> bytes:
    """``n`` choices of one token each, then their finish events; choice 0 says the body."""
    m = _N.search(body)
    n = int(m.group(1)) if m else 1
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(i: int, text: str | None) -> bytes:
        piece: dict[str, object] = ({"delta": {} if text is None else {"content": text}}
                                    if chat else {"text": text or ""})  # fmt: skip
        choice = {"index": i, **piece, "finish_reason": None if text else "length"}
        doc = {"id": "cmpl-stub", "created": 0, "model": model, "object": kind,
               "choices": [choice]}  # fmt: skip
        return _chunk(b"data: " + json.dumps(doc).encode() + b"\n\n")

    said = [event(i, body.decode() if i == 0 else " tok") for i in range(n)]
    return b"".join(said + [event(i, None) for i in range(n)])


class StubEngine:
    def __init__(self, loop: asyncio.AbstractEventLoop, model: str, tokens: int, ttft_s: float,
                 itl_s: float) -> None:  # fmt: skip
        self.loop, self.model, self.tokens = loop, model, tokens
        self.ttft_s, self.itl_s = ttft_s, itl_s
        self.answers = Answers(model)
        self.port = 0
        self.served = 0
        self.aborted = 0


def engines_file(ports: list[int], model: str, host: str = "127.0.0.1") -> str:
    """An engines file for the stub's ports (no KV events: approximate cache credit)."""
    out = []
    for i, port in enumerate(ports):
        out.append(
            f'[[engines]]\nworker_id = "stub-{i}"\nmodel = "{model}"\nengine = "vllm"\n'
            f'http_url = "http://{host}:{port}"\nkv_events = false\n'
            "reports_cached_tokens = false\nblock_size = 16\ngpu_blocks = 65536\n"
            "[engines.scheduler]\nmax_num_batched_tokens = 8192\nmax_num_seqs = 256\n"
        )
    return "\n".join(out)


def _factory(engine: StubEngine) -> Callable[[], StubProtocol]:
    return lambda: StubProtocol(engine)


async def serve(ports: list[int], model: str, tokens: int, ttft_s: float, itl_s: float,
                engines_out: Path | None = None, host: str = "127.0.0.1") -> None:  # fmt: skip
    """Listen on every port; then write the engines file (so that it means "ready")."""
    loop = asyncio.get_running_loop()
    servers = []
    for port in ports:
        engine = StubEngine(loop, model, tokens, ttft_s, itl_s)
        engine.port = port
        servers.append(await loop.create_server(_factory(engine), host, port, backlog=4096))
    if engines_out is not None:
        tmp = engines_out.with_suffix(".tmp")
        tmp.write_text(engines_file(ports, model, host))
        tmp.rename(engines_out)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ports", required=True, help="comma-separated listen ports")
    parser.add_argument("--model", default="stub-model")
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--itl-ms", type=float, default=5.0)
    parser.add_argument("--engines-out", type=Path, default=None)
    args = parser.parse_args()
    ports = [int(p) for p in args.ports.split(",")]
    import uvloop

    uvloop.run(serve(ports, args.model, args.tokens, args.ttft_ms / 1000, args.itl_ms / 1000,
                     args.engines_out))  # fmt: skip


if __name__ == "__main__":
    main()
