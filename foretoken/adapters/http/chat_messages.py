"""A chat request's messages and tools in the shapes vLLM hands its chat template (vLLM
0.12's ``entrypoints/chat_utils.py`` and request models, re-described here):

- a message keeps ``role`` and ``content``; an assistant's ``tool_calls`` (when not null) and
  its ``reasoning`` (given as ``reasoning``, passed as both ``reasoning`` and
  ``reasoning_content``; a client's own ``reasoning_content`` does not survive vLLM's request
  validation); a tool message's ``tool_call_id``; a ``name`` that is a string. Nothing else.
- content, for a template that takes a string (the "string" format): the text of its text
  parts (``text``, ``input_text``, ``refusal``, ``thinking``), empty ones skipped, joined by
  newlines; media parts carry no text. For a template that walks the parts (the "openai"
  format): a list — a string content becomes one text part, null none, and a media part a
  bare ``{"type": "image"}`` (``audio``, ``video``).
- a tool call's JSON ``arguments`` are parsed (into whatever JSON value they hold); empty or
  missing ones become ``{}``; arguments that are not JSON are refused (vLLM answers 400),
  and so are ones nested deeper than ``json.loads`` goes or holding a lone surrogate escape
  (``"\\ud83d"`` without its pair: a string with no UTF-8, which no tokenizer takes) — the
  router's 400, where the engine would fail on them.
- a tool becomes ``{"type", "function": {"name", "description", "parameters", …}, …}``:
  missing description and parameters are null, and the declared keys come before any other.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final, Literal

ContentFormat = Literal["string", "openai"]
TEXT_KEYS: Final = {"text": "text", "input_text": "text", "refusal": "refusal",
                    "thinking": "thinking"}  # fmt: skip
MEDIA: Final = ("image", "audio", "video")
# How a JSON text writes a surrogate (D800–DFFF) escape. The request's own JSON is decoded
# strictly (a lone one refused): only a string decoded again here can hold one.
_SURROGATE_ESCAPES: Final = ("\\ud", "\\uD")


class MessageError(ValueError):
    """A message or tool the engine would refuse (its request validation)."""


def conversation(messages: Any, content_format: ContentFormat) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise MessageError("messages must be a list")
    return [_message(m, content_format) for m in messages]


def _message(m: Any, fmt: ContentFormat) -> dict[str, Any]:
    if not isinstance(m, Mapping):
        raise MessageError("every message must be an object")
    role = m.get("role")
    out: dict[str, Any] = {"role": role, "content": _content(m.get("content"), fmt)}
    if role == "assistant":
        if m.get("tool_calls") is not None:
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                raise MessageError("tool_calls must be a list")
            out["tool_calls"] = [_call(c) for c in calls]
        if m.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = m["reasoning"]
    elif role == "tool" and "tool_call_id" in m:
        out["tool_call_id"] = m["tool_call_id"]
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def _content(content: Any, fmt: ContentFormat) -> Any:
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = content
    else:
        raise MessageError("a message's content must be a string, a list of parts or null")
    texts: list[Any] = []
    for part in parts:
        if isinstance(part, str):  # vLLM takes bare strings among the parts as text
            texts.append({"type": "text", "text": part} if fmt == "openai" else part)
            continue
        if not isinstance(part, Mapping):
            raise MessageError("a content part must be an object")
        kind = str(part.get("type") or "")
        if kind in TEXT_KEYS:
            text = part.get(TEXT_KEYS[kind])
            if text is not None:
                texts.append({"type": "text", "text": text} if fmt == "openai" else str(text))
        elif fmt == "openai":
            texts.append({"type": next((m for m in MEDIA if m in kind), kind)})
    return texts if fmt == "openai" else "\n".join(t for t in texts if t)


def _call(call: Any) -> Any:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    args = function.get("arguments")
    if not args:
        function["arguments"] = {}
    elif isinstance(args, str):
        try:
            function["arguments"] = json.loads(args)
        except ValueError as exc:
            raise MessageError(f"a tool call's arguments are not JSON: {exc}") from exc
        except RecursionError as exc:
            raise MessageError("a tool call's arguments are nested too deeply to decode") from exc
        if any(e in args for e in _SURROGATE_ESCAPES) and _lone_surrogate(function["arguments"]):
            raise MessageError("a tool call's arguments hold a lone UTF-16 surrogate escape "
                               "(half a character, as '\\ud83d' alone): not text a tokenizer "
                               "takes")  # fmt: skip
    return {**call, "function": function}


def _lone_surrogate(value: Any) -> bool:
    """Whether a decoded JSON value holds a string (a key too) with a lone surrogate (a
    ``\\udXXX`` escape without its pair decodes to one; it has no UTF-8). Walked without
    recursion: the value may be nested as deep as ``json.loads`` goes."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def tool_schemas(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise MessageError("tools must be a list")
    out = []
    for tool in tools:
        if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
            raise MessageError("every tool must be an object with a function")
        fn = tool["function"]
        if not isinstance(fn.get("name"), str):
            raise MessageError("every tool's function needs a name")
        function = {"name": fn["name"], "description": fn.get("description"),
                    "parameters": fn.get("parameters")}  # fmt: skip
        function.update({k: v for k, v in fn.items() if k not in function})
        schema = {"type": tool.get("type", "function"), "function": function}
        schema.update({k: v for k, v in tool.items() if k not in schema})
        out.append(schema)
    return out
