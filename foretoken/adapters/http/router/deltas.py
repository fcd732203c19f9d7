"""What the translating relays (Anthropic, Responses) read of an engine's chat completion
events: each choice's delta — its text, its tool-call pieces — and finish reason. Events
that are not JSON objects are skipped (the proxy measured them already)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from foretoken.adapters.http.router.proxy import Chunk, event_docs


@dataclass(frozen=True, slots=True)
class Delta:
    text: str | None
    tool_calls: list[Any]
    finish_reason: str | None
    choice: Mapping[str, Any]
    # a reasoning model's thinking (the engine's reasoning parser: vLLM's and SGLang's
    # ``reasoning_content``, newer vLLM's ``reasoning``)
    reasoning: str | None = None


def deltas(events: list[tuple[bytes, Chunk | None]]) -> Iterator[Delta]:
    for _, doc in event_docs(events):
        for c in doc.get("choices") or ():
            if not isinstance(c, dict):
                continue
            given = c.get("delta")
            delta: Mapping[str, Any] = given if isinstance(given, dict) else {}
            text = delta.get("content")
            calls = delta.get("tool_calls")
            thought = delta.get("reasoning_content") or delta.get("reasoning")
            yield Delta(text if isinstance(text, str) and text else None,
                        calls if isinstance(calls, list) else [],
                        c.get("finish_reason") if isinstance(c.get("finish_reason"), str) else None,
                        c, thought if isinstance(thought, str) and thought else None)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ToolPiece:
    """One piece of a streamed tool call: its index, and what this piece says of it."""

    index: int
    call_id: str | None
    name: str | None
    arguments: str


def tool_pieces(calls: list[Any], known: int) -> Iterator[ToolPiece]:
    """The pieces of one delta's ``tool_calls`` (``known``: calls seen so far, the index of a
    piece that gives none)."""
    for d in calls:
        if not isinstance(d, Mapping):
            continue
        given = d.get("index")
        index = given if isinstance(given, int) else known
        given_fn = d.get("function")
        fn: Mapping[str, Any] = given_fn if isinstance(given_fn, Mapping) else {}
        name = fn.get("name")
        args = fn.get("arguments")
        yield ToolPiece(index, d.get("id") if isinstance(d.get("id"), str) else None,
                        name if isinstance(name, str) else None,
                        args if isinstance(args, str) else "")  # fmt: skip
