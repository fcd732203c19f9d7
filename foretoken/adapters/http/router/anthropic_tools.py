"""Anthropic tool use over OpenAI-speaking engines (``/v1/messages``).

Request: ``tools`` (``name``, ``description``, ``input_schema``; ``cache_control`` taken)
become OpenAI function tools; ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none``
becomes ``auto`` / ``required`` / the named function / ``none``, and its
``disable_parallel_tool_use`` ``parallel_tool_calls: false``; an assistant turn's
``tool_use`` blocks become its ``tool_calls`` (the input as JSON arguments), and a user
turn's ``tool_result`` blocks become ``tool`` messages before its text, as the chat
completion API orders them (an ``is_error`` result's text starts with ``Error: ``: the chat
API has no such flag). Anthropic's server tools (``web_search_…``, ``bash_…``: a
``type`` other than ``custom``) run at Anthropic, not in an engine, and are refused.

Answer: the engine's ``tool_calls`` deltas become ``tool_use`` content blocks after the
text block — ``content_block_start`` (id, name, empty input), ``input_json_delta`` pieces,
``content_block_stop`` — and, not streamed, ``tool_use`` blocks with the parsed input; a
finish reason of ``tool_calls`` is a ``tool_use`` stop.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Final

from foretoken.adapters.http.router.deltas import tool_pieces
from foretoken.adapters.http.router.requests import RequestError, tool_list

Event = Callable[[str, dict[str, Any]], bytes]
# A tool result marked ``is_error``: the chat API has no flag for it, so its text says it.
ERROR_PREFIX = "Error: "


# A custom tool's fields: taken (the engine gets them), or accepted as asking for nothing
# (``cache_control``: the engines cache prefixes on their own; ``eager_input_streaming``:
# the input is streamed as the engine makes it anyway). The others a tool may name are
# refused unless they ask for nothing (``defer_loading``: the tool left out of the prompt,
# ``input_examples``, ``allowed_callers`` other than direct), and so is an unknown field.
TOOL_FIELDS: Final = frozenset({"type", "name", "description", "input_schema", "strict",
                                "cache_control", "eager_input_streaming"})  # fmt: skip
_ASKS_NOTHING: Final = {"defer_loading": (False,), "input_examples": ([],),
                        "allowed_callers": (["direct"],)}  # fmt: skip


def _check_fields(tool: Mapping[str, Any], where: str) -> None:
    for key, value in tool.items():
        if key in TOOL_FIELDS or value is None or value in _ASKS_NOTHING.get(key, ()):
            continue
        raise RequestError(f"{where}.{key}: not a field of a custom tool, or not supported by "
                           "this router", param=f"{where}.{key}")  # fmt: skip
    for key, kind, name in (("description", str, "a string"), ("strict", bool, "a boolean")):
        if tool.get(key) is not None and not isinstance(tool[key], kind):
            raise RequestError(f"{where}.{key} must be {name}", param=f"{where}.{key}")


def tools(value: Any) -> list[dict[str, Any]] | None:
    """The request's tools as OpenAI function tools (None: no tools)."""
    given = tool_list(value)
    if given is None:
        return None
    out = []
    for i, tool in enumerate(given):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise RequestError(f"{where} must be an object", param=where)
        kind = tool.get("type")
        if kind not in (None, "custom"):  # (null: a custom tool, as the SDK types it)
            raise RequestError(f"{where}.type: Anthropic's server tools ({kind!r}) run at "
                               "Anthropic, not in this fleet's engines",
                               param=f"{where}.type")  # fmt: skip
        _check_fields(tool, where)
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise RequestError(f"{where}.name is required", param=f"{where}.name")
        if not isinstance(schema, Mapping):
            raise RequestError(f"{where}.input_schema must be an object",
                               param=f"{where}.input_schema")  # fmt: skip
        function: dict[str, Any] = {"name": name, "parameters": dict(schema)}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if tool.get("strict") is not None:  # strict schema: the engine's to honour
            function["strict"] = tool["strict"]
        out.append({"type": "function", "function": function})
    return out


# tool_choice's fields by its type (any other is refused, never dropped)
CHOICE_FIELDS: Final = {"auto": {"type", "disable_parallel_tool_use"},
                        "any": {"type", "disable_parallel_tool_use"},
                        "tool": {"type", "name", "disable_parallel_tool_use"},
                        "none": {"type"}}  # fmt: skip


def tool_choice(value: Any, has_tools: bool) -> dict[str, Any]:
    """The upstream fields of ``tool_choice`` (``tool_choice``, ``parallel_tool_calls``)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or value.get("type") not in ("auto", "any", "tool", "none"):
        raise RequestError("tool_choice.type must be auto, any, tool or none",
                           param="tool_choice")  # fmt: skip
    kind = value["type"]
    for key in value:
        if key not in CHOICE_FIELDS[kind]:
            raise RequestError(f"tool_choice.{key}: not a field of tool_choice {kind!r}, or not "
                               "supported by this router", param=f"tool_choice.{key}")  # fmt: skip
    if value.get("disable_parallel_tool_use") not in (None, True, False):
        raise RequestError("tool_choice.disable_parallel_tool_use must be a boolean",
                           param="tool_choice.disable_parallel_tool_use")  # fmt: skip
    if kind == "none":
        return {"tool_choice": "none"} if has_tools else {}
    if not has_tools:
        raise RequestError(f"tool_choice {kind!r} needs tools", param="tool_choice")
    out: dict[str, Any] = {"tool_choice": {"auto": "auto", "any": "required"}.get(kind)}
    if kind == "tool":
        if not isinstance(value.get("name"), str):
            raise RequestError("tool_choice.name is required for type tool",
                               param="tool_choice.name")  # fmt: skip
        out["tool_choice"] = {"type": "function", "function": {"name": value["name"]}}
    if value.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


def call(block: Any, where: str) -> dict[str, Any]:
    """An assistant's ``tool_use`` block as an OpenAI tool call."""
    if not isinstance(block.id, str) or not isinstance(block.name, str):
        raise RequestError(f"{where}: a tool_use block needs an id and a name", param=where)
    if block.input is not None and not isinstance(block.input, Mapping):
        raise RequestError(f"{where}.input must be an object", param=f"{where}.input")
    try:
        arguments = json.dumps(block.input or {}, ensure_ascii=False, separators=(",", ":"))
    except RecursionError as exc:  # decoded (the body's depth limit) but too deep to write
        raise RequestError(f"{where}.input is nested too deeply", param=f"{where}.input") from exc
    return {"id": block.id, "type": "function",
            "function": {"name": block.name, "arguments": arguments}}  # fmt: skip


def result(block: Any, where: str) -> dict[str, Any]:
    """A user's ``tool_result`` block as an OpenAI ``tool`` message."""
    if not isinstance(block.tool_use_id, str):
        raise RequestError(f"{where}.tool_use_id is required", param=f"{where}.tool_use_id")
    content = block.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise RequestError(f"{where}.content[{j}]: only text is supported in a tool "
                                   "result by this router",
                                   param=f"{where}.content[{j}]")  # fmt: skip
            texts.append(str(part.get("text") or ""))
        content = texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
    elif content is not None and not isinstance(content, str):
        raise RequestError(f"{where}.content must be text or text blocks",
                           param=f"{where}.content")  # fmt: skip
    if block.is_error is True:  # the chat API has no such flag: the model reads it instead
        if isinstance(content, list):
            content = [{"type": "text", "text": ERROR_PREFIX.strip()}, *content]
        else:
            content = ERROR_PREFIX + (content or "")
    elif block.is_error not in (None, False):
        raise RequestError(f"{where}.is_error must be a boolean", param=f"{where}.is_error")
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content or ""}


class ToolCalls:
    """The engine's streamed tool calls, as Anthropic ``tool_use`` blocks after the blocks
    before them (thinking, text), if any — else from block 0 (as Anthropic answers a forced
    tool call: no empty text block first)."""

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, Any]] = {}  # OpenAI index → id, name, argument pieces
        self.open: int | None = None  # the OpenAI index whose block is open
        self.base = 1  # the block of the first tool call

    def block_of(self, index: int) -> int:
        return self.base + sorted(self.calls).index(index)

    def add(self, calls: list[Any], event: Event | None, open_block: int | None = None,
            first: int = 0) -> list[bytes]:  # fmt: skip
        """One event's ``tool_calls`` deltas; the Anthropic events they make (streaming).
        ``open_block``: the block still open before them (it is closed, and they follow
        it); ``first``: the block of the first tool call."""
        out: list[bytes] = []
        for piece in tool_pieces(calls, len(self.calls)):
            index = piece.index
            entry = self.calls.get(index)
            if entry is None:
                if not self.calls:
                    self.base = first
                entry = self.calls[index] = {"id": piece.call_id or f"toolu_{index}",
                                             "name": piece.name or "", "args": []}  # fmt: skip
                if event is not None:
                    closing = self.block_of(self.open) if self.open is not None else open_block
                    if closing is not None:
                        out.append(event("content_block_stop", {"index": closing}))
                    block = {"type": "tool_use", "id": entry["id"], "name": entry["name"],
                             "input": {}}  # fmt: skip
                    out.append(event("content_block_start", {"index": self.block_of(index),
                                                             "content_block": block}))  # fmt: skip
                self.open = index
            if piece.arguments:
                entry["args"].append(piece.arguments)
                if event is not None:
                    delta = {"type": "input_json_delta", "partial_json": piece.arguments}
                    out.append(event("content_block_delta",
                                     {"index": self.block_of(index), "delta": delta}))  # fmt: skip
        return out

    def last_block(self) -> int | None:
        """The last tool's block, still open at the end (None: no tool call)."""
        return self.block_of(self.open) if self.open is not None else None

    def blocks(self) -> list[dict[str, Any]]:
        """The ``tool_use`` blocks of a whole answer (input parsed; ``{}`` when the engine's
        arguments are not a JSON object)."""
        out = []
        for index in sorted(self.calls):
            entry = self.calls[index]
            try:
                value = json.loads("".join(entry["args"]) or "{}")
            except ValueError:
                value = {}
            out.append({"type": "tool_use", "id": entry["id"], "name": entry["name"],
                        "input": value if isinstance(value, dict) else {}})  # fmt: skip
        return out
