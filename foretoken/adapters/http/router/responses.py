"""OpenAI's Responses API in front of chat-completion engines: ``POST /v1/responses``.

The subset a stateless router can serve, decoded strictly: ``input`` as a string or a list
of messages (``user``, ``system``, ``developer`` — sent as ``system`` —, ``assistant``;
content as a string or ``input_text`` / ``output_text`` / ``refusal`` parts), the model's
``function_call`` items and their ``function_call_output`` (the assistant's tool calls and
``tool`` messages), ``instructions`` (a system message first), function ``tools``,
``tool_choice``, ``parallel_tool_calls``, ``max_output_tokens``, ``temperature``, ``top_p``,
``user``, ``metadata``, vLLM's ``cache_salt``, structured output (``text.format``
``json_schema`` or ``json_object``: the chat completion's ``response_format``, the engine's
guided decoding); accepted as nothing to do: ``store: false``, ``service_tier``,
``truncation: "disabled"``, ``prompt_cache_key``, ``safety_identifier``,
``stream_options``; ``reasoning`` (its ``effort`` sent as the chat completion's
``reasoning_effort``; a ``summary`` taken, none made), ``include:
["reasoning.encrypted_content"]`` (none made) and an earlier answer's ``reasoning`` items
(left out of the context). What it cannot honour — hosted tools (web search, file search,
…), a ``previous_response_id`` or ``conversation`` or ``store: true`` (no state kept),
images and files, ``truncation: "auto"``, ``text.verbosity``, any other ``include``,
background mode — is refused with a 400 naming it, never dropped.

The request becomes the chat completion the engine streams (the messages and tools the
router tokenizes, so what is routed is what is prefilled); the engine's events come back as
the Responses API's output items and events (``responses_relay.py``).
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta

from foretoken.adapters.http.router.requests import (
    INT32_MAX,
    RequestError,
    RoutingFields,
    ShortText,
    json_error,
    tool_list,
)
from foretoken.core.tokenizer import content_text, transcript

TEXT_PARTS: Final = ("input_text", "output_text", "text", "refusal")
ROLES: Final = {"user": "user", "system": "system", "developer": "system",
                "assistant": "assistant"}  # fmt: skip
_encoder = msgspec.json.Encoder()
_json = msgspec.json.Decoder()


class Part(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A content part: text is taken; the other types' fields are named so that a part is
    refused for its type, not for its first field."""

    type: ShortText
    text: str | None = None
    refusal: str | None = None  # an assistant turn's refusal part (sent back as history)
    annotations: Any = None  # an assistant turn's output_text (sent back as history)
    logprobs: Any = None
    image_url: Any = None
    file_id: Any = None
    file_data: Any = None
    file_url: Any = None
    filename: Any = None
    detail: Any = None
    input_audio: Any = None


class Item(msgspec.Struct, kw_only=True):
    """An input item: a message, a function call the model made or its output (other item
    types hold fields of their own, so the struct takes any field and the type decides)."""

    type: ShortText | None = None
    role: ShortText | None = None
    content: str | list[Part] | None = None
    # function_call / function_call_output
    call_id: Annotated[str, Meta(max_length=256)] | None = None
    name: Annotated[str, Meta(max_length=256)] | None = None
    arguments: str | None = None
    output: str | list[Part] | None = None


class ResponsesBody(RoutingFields, kw_only=True, forbid_unknown_fields=True):
    model: Annotated[str, Meta(min_length=1, max_length=256)]
    input: str | list[Item]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None
    stream: bool | None = False
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    user: ShortText | None = None
    metadata: Annotated[dict[Annotated[str, Meta(max_length=64)],
                             Annotated[str, Meta(max_length=512)]],
                        Meta(max_length=16)] | None = None  # OpenAI's limits  # fmt: skip
    # vLLM's: the engine keys the prompt's first block with it (forwarded)
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    # accepted: nothing to do for them here (store: false only; nothing is stored)
    store: bool | None = None
    service_tier: ShortText | None = None
    truncation: Literal["disabled", "auto"] | None = None  # auto: refused, with the reason
    parallel_tool_calls: bool | None = None
    prompt_cache_key: ShortText | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: ShortText | None = None
    stream_options: Any = None
    # refused unless they ask for nothing (below)
    tools: Any = None
    tool_choice: Any = None
    previous_response_id: Any = None
    conversation: Any = None
    reasoning: Any = None
    include: Any = None
    background: Any = None
    prompt: Any = None
    text: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None


_body = msgspec.json.Decoder(ResponsesBody)


def _asks_nothing(value: Any) -> bool:
    return value is None or value is False or value == [] or value == 0


JSON_SCHEMA_KEYS: Final = ("name", "schema", "strict", "description")


def response_format(text: Any) -> dict[str, Any] | None:
    """``text`` as the chat completion's ``response_format`` (None: plain text). Structured
    output (``json_schema``, as the SDK's ``responses.parse`` sends, or ``json_object``) is
    the engine's guided decoding; a ``verbosity`` other than medium is refused."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise RequestError("text must be an object with format (and verbosity)", param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise RequestError("text.verbosity is not supported by this router (the engines have "
                           "no such control): leave it out or send medium",
                           param="text.verbosity")  # fmt: skip
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise RequestError("text.format json_schema needs a name and a schema",
                               param="text.format")  # fmt: skip
        schema = {k: fmt[k] for k in JSON_SCHEMA_KEYS if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise RequestError("text.format.type must be text, json_object or json_schema",
                       param="text.format.type")  # fmt: skip


def _texts(content: str | list[Part] | None, where: str) -> str | list[str]:
    """A message's text: a string, or its parts' texts (sent to the engine as parts, which
    its chat template joins as it does for chats)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS:
            raise RequestError(f"{where}[{j}].type: content parts of type {part.type!r} are not "
                               "supported by this router (text only)",
                               param=f"{where}[{j}].type")  # fmt: skip
        text = part.refusal if part.type == "refusal" else part.text
        if text is None:
            field = "refusal" if part.type == "refusal" else "text"
            raise RequestError(f"{where}[{j}].{field} is required",
                               param=f"{where}[{j}].{field}")  # fmt: skip
        texts.append(text)
    return texts


REFUSED: Final = (
    "previous_response_id", "conversation", "background", "prompt", "top_logprobs",
    "max_tool_calls",
)  # fmt: skip
EFFORTS: Final = ("none", "minimal", "low", "medium", "high", "xhigh")
SUMMARIES: Final = ("auto", "concise", "detailed")
# what ``include`` may ask for: an encrypted copy of the reasoning to send back (none is
# made: an earlier answer's reasoning item sent back is left out of the context anyway)
INCLUDABLE: Final = ("reasoning.encrypted_content",)


def _reasoning_effort(value: Any) -> str | None:
    """``reasoning`` checked: its ``effort`` goes to the engine (``reasoning_effort``: what
    a reasoning model's chat template reads); a ``summary`` is taken, none is made (no
    summarizer here: the reasoning item carries the model's reasoning text itself)."""
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise RequestError("reasoning must be an object", param="reasoning")
    for key, allowed in (("effort", EFFORTS), ("summary", SUMMARIES),
                         ("generate_summary", SUMMARIES)):  # fmt: skip
        if value.get(key) is not None and value[key] not in allowed:
            raise RequestError(f"reasoning.{key} must be one of {', '.join(allowed)}",
                               param=f"reasoning.{key}")  # fmt: skip
    for key in value:
        if key not in ("effort", "summary", "generate_summary"):
            raise RequestError(f"reasoning.{key} is not supported by this router",
                               param=f"reasoning.{key}")  # fmt: skip
    effort = value.get("effort")
    return effort if isinstance(effort, str) else None


def _include(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, list):
        raise RequestError("include must be a list", param="include")
    for i, name in enumerate(value):
        if name not in INCLUDABLE:
            only = ", ".join(INCLUDABLE)
            raise RequestError(f"include[{i}]: {name!r} is not supported by this router "
                               f"(only {only})", param=f"include[{i}]")  # fmt: skip


# a function tool's fields the chat completion takes; another is refused unless it asks
# for nothing (null, false, [])
FUNCTION_FIELDS: Final = frozenset({"type", "name", "description", "parameters", "strict"})


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """Function tools as the chat completion's (other tool types run at OpenAI: refused)."""
    given = tool_list(value)
    if given is None:
        return None
    out = []
    for i, tool in enumerate(given):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise RequestError(
                f"tools[{i}].type: {kind!r} tools are not supported by this "
                "router (function tools only)",
                param=f"tools[{i}].type",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise RequestError(f"tools[{i}].name is required", param=f"tools[{i}].name")
        for key, value in tool.items():  # refused, never dropped (defer_loading: true, …)
            if key not in FUNCTION_FIELDS and not _asks_nothing(value):
                where = f"tools[{i}].{key}"
                raise RequestError(f"{where}: not a field of a function tool, or not supported "
                                   "by this router", param=where)  # fmt: skip
        for key, kind, what in (("description", str, "a string"), ("strict", bool, "a boolean"),
                                ("parameters", dict, "an object")):  # fmt: skip
            if tool.get(key) is not None and not isinstance(tool[key], kind):
                raise RequestError(f"tools[{i}].{key} must be {what}", param=f"tools[{i}].{key}")
        function = {"name": tool["name"]}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value: Any, has_tools: bool) -> Any:
    """``tool_choice`` as the chat completion's (None: leave it out)."""
    if value is None or (value in ("none", "auto") and not has_tools):
        return None
    if value in ("none", "auto", "required"):
        if value == "required" and not has_tools:
            raise RequestError("tool_choice required needs tools", param="tool_choice")
        return value
    if (isinstance(value, dict) and value.get("type") == "function"
            and isinstance(value.get("name"), str) and has_tools):  # fmt: skip
        return {"type": "function", "function": {"name": value["name"]}}
    raise RequestError("tool_choice must be none, auto, required or a function of the tools "
                       "given", param="tool_choice")  # fmt: skip


def _joined(first: str | list[dict[str, Any]], second: str | list[dict[str, Any]]) -> Any:
    """Two system turns' contents as one (strings with a blank line between; else parts)."""
    if isinstance(first, str) and isinstance(second, str):
        return f"{first}\n\n{second}"

    def parts(c: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"type": "text", "text": c}] if isinstance(c, str) else c

    return parts(first) + parts(second)


def _output_text(value: str | list[Part] | None, where: str) -> str:
    texts = _texts(value, where)
    return texts if isinstance(texts, str) else "".join(texts)


def _messages(body: ResponsesBody) -> list[dict[str, Any]]:
    """The chat completion's messages: instructions first, then the input's messages, the
    model's function calls (the assistant's ``tool_calls``) and their outputs (``tool``
    messages)."""
    for name in REFUSED:
        if not _asks_nothing(getattr(body, name)):
            raise RequestError(f"{name} is not supported by this router (a stateless, text-only "
                               "Responses API)", param=name)  # fmt: skip
    if body.truncation == "auto":
        raise RequestError("truncation: auto is not supported by this router (it never drops "
                           "input): send disabled", param="truncation")  # fmt: skip
    if body.store:
        raise RequestError("store: true is not supported by this router (it keeps no "
                           "responses): send store: false", param="store")  # fmt: skip
    _include(body.include)
    out: list[dict[str, Any]] = (
        [{"role": "system", "content": body.instructions}] if body.instructions else []
    )
    if isinstance(body.input, str):
        return [*out, {"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        at = f"input[{i}]"
        if item.type == "function_call":
            if item.call_id is None or item.name is None:
                raise RequestError(f"{at}: a function_call needs a call_id and a name", param=at)
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments or "{}"},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            continue
        if item.type == "function_call_output":
            if item.call_id is None:
                raise RequestError(f"{at}.call_id is required", param=f"{at}.call_id")
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _output_text(item.output, f"{at}.output")})  # fmt: skip
            continue
        if item.type == "reasoning":
            continue  # an earlier answer's reasoning: out of the context, as chat templates do
        if item.type not in (None, "message"):
            raise RequestError(f"{at}.type: input items of type {item.type!r} are not "
                               "supported by this router (messages and function calls)",
                               param=f"{at}.type")  # fmt: skip
        role = ROLES.get(item.role or "")
        if role is None:
            raise RequestError(f"{at}.role must be one of {sorted(ROLES)}", param=f"{at}.role")
        texts = _texts(item.content, f"{at}.content")
        content = texts if isinstance(texts, str) else [{"type": "text", "text": x} for x in texts]
        if role == "system" and out and all(m["role"] == "system" for m in out):
            # instructions and leading system/developer items: one system message (chat
            # templates refuse a system message after the first)
            out[-1]["content"] = _joined(out[-1]["content"], content)
            continue
        out.append({"role": role, "content": content})
    if not out:
        raise RequestError("input has no messages", param="input")
    return out


def decode_responses(raw: bytes) -> tuple[ResponsesBody, str, bytes, dict[str, Any]]:
    """The body, the built-in transcript, the engine's chat completion body, and its chat
    (messages and tools: what a chat template renders)."""
    try:
        body = _body.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise json_error(exc, raw) from exc
    chat: dict[str, Any] = {"messages": _messages(body)}
    tools = _tools(body.tools)
    if tools is not None:
        chat["tools"] = tools
    choice = _tool_choice(body.tool_choice, tools is not None)
    if choice is not None:
        chat["tool_choice"] = choice
    if tools is not None and body.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    upstream: dict[str, Any] = {"model": body.model, **chat, "stream": True,
                                "stream_options": {"include_usage": True}}  # fmt: skip
    structured = response_format(body.text)
    if structured is not None:
        upstream["response_format"] = structured
    effort = _reasoning_effort(body.reasoning)
    if effort is not None:
        upstream["reasoning_effort"] = effort
    sent_as = (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
               ("top_p", "top_p"), ("user", "user"), ("cache_salt", "cache_salt"))  # fmt: skip
    for name, sent in sent_as:
        if getattr(body, name) is not None:
            upstream[sent] = getattr(body, name)
    turns = ((m["role"], content_text(m.get("content"))) for m in chat["messages"])
    return body, transcript(turns), _encoder.encode(upstream), chat
