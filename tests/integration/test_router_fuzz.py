"""Fuzzing the real router process (issue 16): tens of thousands of generated request bodies
and headers on every POST endpoint, and not one answer ≥ 500, no traceback in its log, its
memory bounded, and normal traffic served afterwards.

Hypothesis generates the seeds — an endpoint, one of its valid bodies with fields set to
generated JSON values (known fields and unknown ones), generated header values — and each
seed is multiplied cheaply (:func:`variants`: a palette of wrong types and out-of-range values,
raw bytes that JSON decoders trip on — NaN, 1e400, lone surrogates, invalid UTF-8, deep
nesting —, bytes flipped, cut or inserted), because generating every body with hypothesis
costs ~25 ms each. Each seed's batch is sent concurrently; the search is derandomized (the
same bodies every run) and bounded (``EXAMPLES`` × ``BATCH``).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from foretoken.settings import Settings
from tests.integration.stub_router import MODEL, StubRouter, stub_engines, stub_router

pytestmark = pytest.mark.integration
EXAMPLES = 320
BATCH = 64
MIN_BODIES = 20_000
MAX_RSS_GROWTH_MB = 300
PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
         "/v1/responses", "/generate", "/v1/embeddings", "/tokenize")  # fmt: skip

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(["", " ", "\u2003", MODEL, "user"])
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
VALID: dict[str, list[dict[str, Any]]] = {
    "/v1/completions": [
        {"model": MODEL, "prompt": "hello world", "max_tokens": 2},
        {"model": MODEL, "prompt": [16, 17, 18], "max_tokens": 2, "stream": True},
        {
            "model": MODEL,
            "prompt": ["one"],
            "max_tokens": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": 1,
        },
        {"model": MODEL, "prompt": ["a", [16, 17], "b"], "max_tokens": 2, "n": 2},
        {
            "model": MODEL,
            "prompt": ["a", "b"],
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ],
    # SGLang's native API (the stub's engines are vLLM's: decoded, then refused) and the
    # endpoints passed through to an engine untouched
    "/generate": [
        {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "stream": True},
        {"input_ids": [16, 17], "model": MODEL, "rid": "r"},
    ],
    "/v1/embeddings": [{"model": MODEL, "input": ["a", "b"], "encoding_format": "float"}],
    "/tokenize": [{"model": MODEL, "prompt": "hi", "add_special_tokens": True}],
    "/v1/chat/completions": [
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        {
            "model": MODEL,
            "max_tokens": 2,
            "stream": True,
            "n": 1,
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "é"}]},
            ],
        },
    ],
    "/v1/messages": [
        {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
        {
            "model": MODEL,
            "max_tokens": 2,
            "stream": True,
            "system": "s",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
        },
    ],
    "/v1/messages/count_tokens": [
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    ],
    "/v1/responses": [
        {"model": MODEL, "input": "hi", "max_output_tokens": 2},
        {
            "model": MODEL,
            "stream": True,
            "instructions": "s",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "x"}]}],
        },
    ],
}
KNOWN = sorted(
    {k for bodies in VALID.values() for b in bodies for k in b}
    | {
        "max_completion_tokens",
        "best_of",
        "max_queue_wait_s",
        "already_waited_s",
        "prefer_cache_hit",
        "workload_class",
        "conversation_id",
        "stop_sequences",
        "temperature",
        "tools",
        "use_beam_search",
        "echo",
        "top_k",
    }
)
PALETTE: list[Any] = [
    None,
    True,
    False,
    "false",
    "no",
    "",
    "   ",
    "\u2003",
    -1,
    0,
    1,
    2**32,
    2**64,
    10**30,
    1.5,
    1e300,
    [],
    {},
    [True, False],
    [-1],
    [2**32],
    ["a", "b"],
    [[1], [2]],
    {"a": 1},
    {"include_usage": "yes"},
    "x" * 3000,
    [{"role": "user"}],
    [{"role": 5, "content": None}],
    ["hi"],
    "hi",
    MODEL,
]
RAW = [
    b"NaN",
    b"-Infinity",
    b"1e400",
    b"-1e400",
    b'"\\ud800"',
    b'"a\\udc00b"',
    b'"\xff\xfe"',
    b'"\xed\xa0\x80"',
    b"[" * 1500 + b"]" * 1500,
    b"{" * 800,
    b'"\\u12"',
    b"01",
    b"1.",
    b"tru",
    b'"unterminated',
]
HEADERS = (
    "x-max-queue-wait-s",
    "x-already-waited-s",
    "x-prefer-cache-hit",
    "x-workload-class",
    "x-request-id",
    "x-conversation-id",
    "authorization",
)
# what an HTTP client lets through in a header value: no control characters
header_value = st.text(
    st.characters(codec="latin-1", categories=("L", "N", "P", "S", "Zs")), max_size=24
)
headers = st.fixed_dictionaries({}, optional=dict.fromkeys(HEADERS, header_value))
# One example: an endpoint, a valid body of it with some fields set to generated values,
# generated headers, and a seed for the cheap variants below.
seeds = st.tuples(
    st.sampled_from(sorted(VALID)).flatmap(
        lambda path: st.tuples(
            st.just(path),
            st.sampled_from(VALID[path]),
            st.dictionaries(st.sampled_from(KNOWN) | st.text(max_size=8), values, max_size=3),
        )
    ),
    headers,
    st.integers(0, 2**32 - 1),
)


def variants(
    path: str, base: dict[str, Any], generated: dict[str, Any], hdrs: dict[str, str], seed: int
) -> list[tuple[str, bytes, dict[str, str]]]:
    """``BATCH`` bodies from one example: the valid body, the generated one, and variants —
    a field set to a value from the palette, a field's value replaced by raw bytes JSON
    decoders trip on, or the serialized body with bytes flipped, cut or inserted."""
    rng = random.Random(seed)
    valid = json.dumps(base).encode()
    out = [(path, valid, {}), (path, json.dumps({**base, **generated}).encode(), hdrs)]
    while len(out) < BATCH:
        body = dict(base)
        roll = rng.random()
        for _ in range(rng.randint(1, 2)):
            body[rng.choice([*KNOWN, "unknown_field"])] = rng.choice(PALETTE)
        raw = json.dumps(body).encode()
        if roll < 0.3:
            key = rng.choice(sorted(body))
            raw = (
                json.dumps({**body, key: "__raw__"}).encode().replace(b'"__raw__"', rng.choice(RAW))
            )
        elif roll < 0.6:
            edited = bytearray(valid)
            for _ in range(rng.randint(1, 3)):
                at = rng.randrange(len(edited) + 1)
                kind = rng.random()
                if kind < 0.4 and at < len(edited):
                    edited[at] = rng.randrange(256)
                elif kind < 0.6:
                    del edited[at:]
                else:
                    edited[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
            raw = bytes(edited)
        elif roll < 0.75:
            raw = valid  # valid bodies with generated headers
        out.append(
            (
                rng.choice(sorted(VALID)) if rng.random() < 0.1 else path,
                raw,
                hdrs if rng.random() < 0.5 else {},
            )
        )
    return out


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _router_pid(r: StubRouter) -> int:
    return r.proc.pid  # one process: the router itself


@pytest.fixture(scope="module")
def router(
    kafka_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StubRouter]:
    tmp = tmp_path_factory.mktemp("fuzz")
    with stub_engines(tmp) as engines, stub_router(kafka_settings, tmp, engines) as r:
        yield r


def test_fuzzed_bodies_never_get_a_5xx(router: StubRouter) -> None:
    loop = asyncio.new_event_loop()
    session = loop.run_until_complete(_session())
    statuses: Counter[int] = Counter()
    failures: list[tuple[int, str, bytes, bytes]] = []
    rss_before = _rss_mb(_router_pid(router))

    async def send(path: str, body: bytes, hdrs: dict[str, str]) -> None:
        async with session.post(router.url + path, data=body, headers=hdrs) as resp:
            answer = await resp.read()
            statuses[resp.status] += 1
            if resp.status >= 500:
                failures.append((resp.status, path, body[:300], answer[:300]))

    async def send_all(reqs: list[tuple[str, bytes, dict[str, str]]]) -> None:
        await asyncio.gather(*(send(p, b, h) for p, b, h in reqs))

    # generate only: a failing body is recorded as it is (shrinking a batch of HTTP calls
    # would take minutes and is not needed to reproduce it)
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(seeds)
    def batch(seed: tuple[tuple[str, dict[str, Any], dict[str, Any]], dict[str, str], int]) -> None:
        (path, base, generated), hdrs, n = seed
        loop.run_until_complete(send_all(variants(path, base, generated, hdrs, n)))

    try:
        batch()
        # normal traffic afterwards, through the official client
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="still here", max_tokens=2).choices
    finally:
        loop.run_until_complete(session.close())
        loop.close()
    total = sum(statuses.values())
    print(f"fuzz: {total} bodies, statuses {dict(sorted(statuses.items()))}")
    assert not failures, failures[:5]
    assert total >= MIN_BODIES
    assert statuses[200] > 0 and statuses[400] > 0  # both paths were exercised
    log = router.log_text()
    assert not re.search(r"Traceback|Error handling request", log), log[-3000:]
    growth = _rss_mb(_router_pid(router)) - rss_before
    assert growth < MAX_RSS_GROWTH_MB, f"router RSS grew {growth:.0f} MB"


async def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=BATCH), timeout=aiohttp.ClientTimeout(total=60)
    )
