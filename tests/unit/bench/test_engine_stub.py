"""The engine stub's usage event names the object of the stream it ends."""

from __future__ import annotations

import json

from foretoken.bench.engine_stub import Answers


def _doc(chunk: bytes) -> dict[str, object]:
    data = chunk.split(b"\r\n", 1)[1].rsplit(b"\r\n", 1)[0]
    return dict(json.loads(data.removeprefix(b"data: ").strip()))


def test_the_usage_event_has_the_object_of_its_stream() -> None:
    answers = Answers("m")
    chat, text = _doc(answers.usage(3, chat=True)), _doc(answers.usage(3, chat=False))
    assert chat["object"] == "chat.completion.chunk" and text["object"] == "text_completion"
    assert chat["choices"] == [] and chat["usage"] == {
        "prompt_tokens": 0, "completion_tokens": 3, "total_tokens": 3}  # fmt: skip
