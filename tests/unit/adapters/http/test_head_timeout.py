"""A client that connects and never finishes its request head (nothing sent, half a head,
or a header line every 0.1 s — a slowloris) is disconnected after the router's keep-alive
timeout, and a whole request on another connection is served meanwhile."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from foretoken.adapters.http.router import app as router_app


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b"drip"])
async def test_a_head_that_never_ends_is_cut_off(monkeypatch, sent: bytes) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(router_app, "KEEPALIVE_S", 0.5)

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    runner = router_app.make_runner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        started = time.monotonic()

        async def drip() -> None:
            writer.write(b"GET /health HTTP/1.1\r\n")
            while True:
                await asyncio.sleep(0.1)
                writer.write(b"X-Slow: 1\r\n")

        dripping = asyncio.create_task(drip()) if sent == b"drip" else None
        if sent and sent != b"drip":
            writer.write(sent)
        ok_reader, ok_writer = await asyncio.open_connection("127.0.0.1", port)
        ok_writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert b"200 OK" in await asyncio.wait_for(ok_reader.read(), 5)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
        assert time.monotonic() - started < 3.0
        if dripping is not None:
            dripping.cancel()
        writer.close()
        ok_writer.close()
    finally:
        await runner.cleanup()
