"""A real benchmark tool end to end, offline: NVIDIA aiperf (``make aiperf``) drives streaming
completions through the router process on the engine stub, with the tokenizer directory the
project ships (``foretoken/bench/hf_tokenizer.py``). It must finish every request without an
error, count tokens as the router does, and see a TTFT that encloses the router's own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from foretoken.bench.aiperf_bench import Load, compare, router_records, run_aiperf
from foretoken.settings import Settings
from tests.integration.stub_router import MODEL, stub_engines, stub_router

pytestmark = pytest.mark.integration

REQUESTS = 40
STUB_TTFT_MS = 20.0  # engine_stub's default delay before the first token


def test_aiperf_through_the_router_offline(kafka_settings: Settings, tmp_path: Path) -> None:
    load = Load(rate_rps=20.0, count=REQUESTS, prompt_tokens=300, output_tokens=4,
                timeout_s=240.0)  # fmt: skip
    with stub_engines(tmp_path) as engines, stub_router(kafka_settings, tmp_path, engines) as r:
        doc = run_aiperf(r.url, MODEL, load, tmp_path)
        view = asyncio.run(router_records(kafka_settings, REQUESTS))
        assert "Traceback" not in r.log_text()
    got = compare(doc, view)
    assert got["aiperf_errors"] == [] and got["aiperf_requests"] == REQUESTS
    assert got["aiperf_ttft_ms"]["count"] == REQUESTS
    # Every request reached the router and the engine, and the router recorded it once.
    assert got["router_grants"] == REQUESTS and got["router_completions"] == REQUESTS
    assert got["router_ttft_ms"]["count"] == REQUESTS
    # The shipped tokenizer counts as the router's: aiperf's 300-token prompts are 300 tokens
    # to the router, and the stub's 4 output tokens are 4 to aiperf.
    assert got["aiperf_input_tokens_p50"] == 300 == got["router_prompt_tokens_p50"]
    assert got["aiperf_output_tokens_p50"] == 4
    # The client's clock encloses the router's (handler entry -> first token), which encloses
    # the stub's fixed delay: per request, so for every percentile too.
    for q in ("p50", "p90", "p99"):
        router_ms, client_ms = got["router_ttft_ms"][q], got["aiperf_ttft_ms"][q]
        assert STUB_TTFT_MS <= router_ms <= client_ms, (q, got)
