"""``n``, ``logprobs`` and ``echo`` on the simulated live engine (sim/live/sampling.py), in
process: the small fleet's engines on free ports, asked through the official openai SDK;
and the pure :class:`Answer` (deterministic logprobs, one prefill for every choice)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from foretoken.core.tokenizer import SimTokenizer
from foretoken.sim.live.sampling import Answer, Sampling, parse_sampling, prompt_echo
from foretoken.sim.live.server import Fleet, SimEngine
from foretoken.sim.spec import load_fleet

MSG: Any = [{"role": "user", "content": "hello there"}]


@pytest.fixture
async def engine() -> AsyncIterator[SimEngine]:
    fleet = Fleet(load_fleet("small"), base_port=0, kv_base_port=0, time_scale=0.2)
    await fleet.start()
    try:
        yield fleet.engines[0]
    finally:
        await fleet.stop()


def _client(engine: SimEngine) -> openai.AsyncOpenAI:
    url = f"http://127.0.0.1:{engine.ports.http}/v1"
    return openai.AsyncOpenAI(base_url=url, api_key="sim", max_retries=0)


async def test_n_choices_whole(engine: SimEngine) -> None:
    c, model = _client(engine), engine.spec.model
    text = await c.completions.create(model=model, prompt="hi there", max_tokens=3, n=2)
    assert [ch.index for ch in text.choices] == [0, 1]
    assert text.choices[0].text != text.choices[1].text
    assert all(ch.finish_reason == "length" and ch.logprobs is None for ch in text.choices)
    assert text.usage is not None and text.usage.completion_tokens == 6
    chat = await c.chat.completions.create(model=model, messages=MSG, max_tokens=2, n=3)
    assert [ch.index for ch in chat.choices] == [0, 1, 2]
    assert all(ch.message.role == "assistant" and ch.message.content for ch in chat.choices)
    assert chat.usage is not None and chat.usage.completion_tokens == 6
    assert chat.usage.prompt_tokens == (await c.chat.completions.create(
        model=model, messages=MSG, max_tokens=2)).usage.prompt_tokens  # type: ignore[union-attr]  # fmt: skip


@pytest.mark.parametrize("chat", [True, False])
async def test_n_choices_streamed(engine: SimEngine, chat: bool) -> None:
    c, model = _client(engine), engine.spec.model
    options: Any = {"stream_options": {"include_usage": True}}
    if chat:
        stream: Any = await c.chat.completions.create(
            model=model, messages=MSG, max_tokens=3, n=2, stream=True, **options
        )
    else:
        stream = await c.completions.create(
            model=model, prompt="hi", max_tokens=3, n=2, stream=True, **options
        )
    events: dict[int, list[Any]] = {0: [], 1: []}
    usage = None
    async for chunk in stream:
        assert len(chunk.choices) <= 1
        for ch in chunk.choices:
            events[ch.index].append(ch)
        usage = chunk.usage or usage
    for choice in events.values():
        if chat:
            assert choice[0].delta.role == "assistant" and choice[0].delta.content == ""
            assert all(ch.delta.role is None for ch in choice[1:])
            texts = [ch.delta.content for ch in choice[1:-1]]
        else:
            texts = [ch.text for ch in choice[:-1]]
        assert len(texts) == 3 and all(texts)
        assert [ch.finish_reason for ch in choice] == [None] * (len(choice) - 1) + ["length"]
    assert usage is not None and usage.completion_tokens == 6


async def test_completion_logprobs_shape(engine: SimEngine) -> None:
    c, model = _client(engine), engine.spec.model
    for k in (0, 3):
        reply = await c.completions.create(model=model, prompt="hi", max_tokens=4, logprobs=k)
        choice = reply.choices[0]
        lp = choice.logprobs
        assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
        assert lp.text_offset is not None and len(lp.tokens) == 4
        assert "".join(lp.tokens) == choice.text
        for token, offset, logprob, top in zip(lp.tokens, lp.text_offset, lp.token_logprobs,
                                               lp.top_logprobs, strict=True):  # fmt: skip
            assert choice.text[offset : offset + len(token)] == token
            assert logprob is not None and logprob < 0 and len(top) == k + 1
            assert top[token] == logprob == max(top.values())
            assert sum(math.exp(v) for v in top.values()) < 1


async def test_chat_logprobs_shape(engine: SimEngine) -> None:
    c, model = _client(engine), engine.spec.model
    reply = await c.chat.completions.create(
        model=model, messages=MSG, max_tokens=3, n=2, logprobs=True, top_logprobs=4
    )
    for choice in reply.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        content = choice.logprobs.content
        assert "".join(e.token for e in content) == choice.message.content and len(content) == 3
        for e in content:
            assert e.logprob < 0 and e.bytes == list(e.token.encode())
            assert len(e.top_logprobs) == 4 and e.top_logprobs[0].token == e.token
            values = [t.logprob for t in e.top_logprobs]
            assert values == sorted(values, reverse=True) and values[0] == e.logprob
    plain = await c.chat.completions.create(model=model, messages=MSG, max_tokens=2,
                                            logprobs=True)  # fmt: skip
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    streamed = await c.chat.completions.create(
        model=model, messages=MSG, max_tokens=2, logprobs=True, top_logprobs=1, stream=True
    )
    entries = [
        e
        async for chunk in streamed
        for ch in chunk.choices
        if ch.logprobs
        for e in ch.logprobs.content or ()
    ]
    assert len(entries) == 2 and all(len(e.top_logprobs) == 1 for e in entries)


async def test_echo(engine: SimEngine) -> None:
    c, model = _client(engine), engine.spec.model
    prompt = "The cat, sat "
    reply = await c.completions.create(model=model, prompt=prompt, max_tokens=2, n=2, echo=True)
    assert all(ch.text.startswith(prompt) and len(ch.text) > len(prompt) for ch in reply.choices)
    ids = await c.completions.create(model=model, prompt=[20, 21], max_tokens=1, echo=True)
    assert ids.choices[0].text.startswith(" t20 t21 ")
    stream = await c.completions.create(model=model, prompt=prompt, max_tokens=2, echo=True,
                                        logprobs=1, stream=True)  # fmt: skip
    chunks = [ch async for chunk in stream for ch in chunk.choices]
    assert chunks[0].text.startswith(prompt) and not chunks[1].text.startswith(prompt)
    lp = chunks[0].logprobs
    assert lp is not None and lp.tokens[:4] == ["The", " cat", ",", " sat"]
    assert lp.token_logprobs is not None and lp.token_logprobs[0] is None
    assert lp.top_logprobs is not None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == 5 and lp.text_offset == [0, 3, 7, 8, len(prompt)]
    assert chunks[1].logprobs is not None and chunks[1].logprobs.text_offset == [
        len(chunks[0].text)]  # fmt: skip


@pytest.mark.parametrize(
    ("chat", "extra", "param"),
    [
        (False, {"n": 0}, "n"),
        (False, {"n": 129}, "n"),
        (True, {"n": "2"}, "n"),
        (False, {"best_of": 3}, "best_of"),
        (False, {"use_beam_search": True}, "use_beam_search"),
        (False, {"prompt_logprobs": 1}, "prompt_logprobs"),
        (False, {"logprobs": 21}, "logprobs"),
        (False, {"logprobs": True}, "logprobs"),
        (False, {"echo": "yes"}, "echo"),
        (True, {"echo": True}, "echo"),
        (True, {"top_logprobs": 2}, "top_logprobs"),
        (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (True, {"logprobs": 1}, "logprobs"),
    ],
)
async def test_what_cannot_be_honoured_is_a_400(
    engine: SimEngine, chat: bool, extra: dict[str, Any], param: str
) -> None:
    c, model = _client(engine), engine.spec.model
    with pytest.raises(openai.BadRequestError) as info:
        if chat:
            await c.chat.completions.create(model=model, messages=MSG, max_tokens=1,
                                            extra_body=extra)  # fmt: skip
        else:
            await c.completions.create(model=model, prompt="x", max_tokens=1, extra_body=extra)
    body: Any = info.value.body
    assert body["param"] == param and body["type"] == "invalid_request_error" and body["message"]
    assert not engine.pending


async def test_nulls_are_the_defaults(engine: SimEngine) -> None:
    reply = await _client(engine).completions.create(
        model=engine.spec.model, prompt="x", max_tokens=1,
        extra_body={"n": None, "echo": None, "logprobs": None, "best_of": None},
    )  # fmt: skip
    assert len(reply.choices) == 1 and reply.choices[0].logprobs is None


async def test_one_prefill_for_every_choice(engine: SimEngine) -> None:
    submitted: list[tuple[int, int]] = []
    submit = engine.model.submit

    def spy(rid: Any, token_ids: Any, max_tokens: int, now_s: float) -> None:
        submitted.append((len(token_ids), max_tokens))
        submit(rid, token_ids, max_tokens, now_s)

    engine.model.submit = spy  # type: ignore[method-assign, assignment]
    reply = await _client(engine).completions.create(model=engine.spec.model, prompt="a b c",
                                                     max_tokens=5, n=4)  # fmt: skip
    assert submitted == [(3, 5)] and len(reply.choices) == 4


def test_logprobs_are_deterministic_and_choices_differ() -> None:
    tok = SimTokenizer()
    sampling = parse_sampling({"n": 2, "logprobs": 2, "echo": True, "seed": 3}, chat=False)
    assert sampling == Sampling(n=2, logprobs=2, echo=True, seed=3)
    runs = []
    for _ in range(2):
        answer = Answer(sampling, False, tok, prompt_echo(tok, "x y", tok.encode("x y")),
                        stream=False, collect=True)  # fmt: skip
        for token in (100, 101):
            answer.step(token)
        runs.append(answer.whole())
    assert runs[0] == runs[1]
    first, second = runs[0]
    assert first["text"] != second["text"] and first["text"].startswith("x y")
    assert answer.completion_tokens == 4
    other = Answer(Sampling(n=1, logprobs=2, seed=4), False, tok, stream=False, collect=True)
    other.step(100)
    drawn = other.whole()[0]["logprobs"]["token_logprobs"]
    assert drawn != first["logprobs"]["token_logprobs"][2:3]  # another seed, other values
