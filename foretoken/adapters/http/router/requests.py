"""The router's edge for OpenAI bodies: decoded once, with msgspec, into typed structs.

``POST /v1/completions`` and ``/v1/chat/completions`` bodies are validated strictly (a
``stream`` of ``"false"`` is an error, not ``True``; ``prompt: [true, false]`` is not token
ids; ``max_tokens`` is an integer in range), and every violation is a :class:`RequestError`
naming the field, answered as a 4xx in the OpenAI error shape. Invalid UTF-8, lone
surrogates, trailing bytes and nesting past the decoder's depth are 400s too.

The body the engine gets is the client's, field for field, values untouched: decoded a
second time as ``{key: msgspec.Raw}`` (each value kept as its original bytes, so a 32k-token
prompt is copied, never re-serialized), minus foretoken's own fields, with ``stream`` on and
usage asked for (the router measures the first token and reads the usage chunk; the client's
other ``stream_options`` keys are kept). Fields the router cannot honour while streaming from
the engine (``best_of`` ≠ ``n``, ``use_beam_search``) are refused with a 400 that says why,
never dropped. A batch of one (``["text"]``, ``[[ids]]``: lm-eval's shape) reaches the engine
as its one prompt; a batch of several is split (:attr:`Decoded.batch`: one engine body per
prompt, each routed as its own request by ``batch.py``). ``null`` is taken where OpenAI's API
takes it (``n``, ``stream``, ``echo``, …: the default). Chat content parts other than text
(images, audio) reach the engine as sent; the router routes on the text the engine's
template makes of the messages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec
import numpy as np
from msgspec import Meta

from foretoken.core.tokenizer import transcript

TOKEN_ID_LIMIT: Final = 1 << 32
# A hard ceiling in the schema; the router's own (settings) is checked after decoding.
INT32_MAX: Final = (1 << 31) - 1
FORETOKEN_FIELDS: Final = (
    "max_queue_wait_s", "already_waited_s", "workload_class", "prefer_cache_hit",
    "conversation_id",
)  # fmt: skip
_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)

TokenId = Annotated[int, Meta(ge=0, lt=TOKEN_ID_LIMIT)]
Count = Annotated[int, Meta(ge=1, le=INT32_MAX)]
ShortText = Annotated[str, Meta(max_length=256)]


class RequestError(Exception):
    """A request the router refuses: HTTP status, message (naming the field), param."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:  # fmt: skip
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = (
            message, param, status, code, kind,
        )  # fmt: skip


class StreamOptions(msgspec.Struct, kw_only=True):
    # the router reads these; every key (these and others) reaches the engine as sent
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class RoutingFields(msgspec.Struct, kw_only=True):
    """foretoken's own fields of a request body (:data:`FORETOKEN_FIELDS`; never forwarded)."""

    max_queue_wait_s: float | None = None
    already_waited_s: float | None = None
    workload_class: ShortText | None = None
    prefer_cache_hit: bool | None = None
    conversation_id: ShortText | None = None


class _Common(RoutingFields, kw_only=True):
    model: Annotated[str, Meta(min_length=1, max_length=256)]
    # null is the default for these, as OpenAI's API takes it
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: Count | None = None
    n: Annotated[int, Meta(ge=1, le=128)] | None = 1
    best_of: Count | None = None
    use_beam_search: bool | None = False
    prompt_logprobs: Any = None  # vLLM's (read to refuse it unstreamed; forwarded as sent)
    # vLLM's: a prompt's tokens with the tokenizer's special ones (completions: yes; chats:
    # no, the template writes them); read to tokenize as the engine does, forwarded as sent
    add_special_tokens: bool | None = None
    # vLLM's: the engine keys the prompt's first block with it (read so that the cache
    # credited is the one the engine reuses; forwarded as sent)
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None


class CompletionBody(_Common, kw_only=True):
    prompt: str | list[str | TokenId | list[TokenId]]
    echo: bool | None = False
    # 0 only with echo (vLLM: score the prompt, generate nothing)
    max_tokens: Annotated[int, Meta(ge=0, le=INT32_MAX)] | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: ShortText
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: ShortText
    # a bare string among the parts is a text part (vLLM takes it so: chat_messages.py)
    content: str | list[ContentPart | str] | None = None


class ChatBody(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: Count | None = None
    # vLLM's and SGLang's: whether the transcript ends with the assistant's prompt (read to
    # tokenize what the engine will prefill; forwarded as sent)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None


Body = CompletionBody | ChatBody
_raw = msgspec.json.Decoder(dict[str, msgspec.Raw])
_raw_list = msgspec.json.Decoder(list[msgspec.Raw])
_completion = msgspec.json.Decoder(CompletionBody)
_chat = msgspec.json.Decoder(ChatBody)
_encoder = msgspec.json.Encoder()
_STREAM_ON = msgspec.Raw(b"true")
_raw_options = msgspec.json.Decoder(dict[str, msgspec.Raw] | None)
_any = msgspec.json.Decoder()


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def json_error(exc: Exception, raw: bytes = b"") -> RequestError:
    """A msgspec (or recursion) failure as a 400 naming the field it happened at."""
    if isinstance(exc, RecursionError):
        return RequestError("the body is nested too deeply to decode")
    text = str(exc)
    if isinstance(exc, msgspec.DecodeError) and _SURROGATE.search(raw):
        text = f"{text} (it holds a UTF-16 surrogate escape without its pair)"
    if isinstance(exc, msgspec.ValidationError):
        m = _AT.match(text)
        path = (m.group("path") or "").lstrip(".") if m else ""
        what = (m.group("what") if m else text).rstrip(".")
        if "unknown field" in what:
            name = what.split("`")[1]
            where = f"{path}.{name}" if path else name
            return RequestError(f"{where}: unknown field, not supported by this router",
                                param=where)  # fmt: skip
        if what.startswith("Object missing required field"):
            name = what.split("`")[1]
            where = f"{path}.{name}" if path else name
            return RequestError(f"{where} is required", param=where)
        if path:
            return RequestError(f"{path}: {what[0].lower()}{what[1:]}", param=path)
        return RequestError(f"the body must be a JSON object: {what}")
    return RequestError(f"the body is not valid JSON: {text}")


@dataclass(frozen=True, slots=True)
class Decoded:
    """One decoded OpenAI request: the typed body, what to tokenize (a text or given token
    ids), and the engine's body."""

    body: Body
    chat: bool
    text: str | None
    token_ids: np.ndarray | None
    upstream: bytes
    wants_usage: bool
    fields: dict[str, msgspec.Raw]
    # a completion prompt that is a batch of several: each prompt's text or token ids and
    # its JSON as sent (``upstream`` then holds the other fields: :meth:`batch_body`)
    batch: tuple[tuple[str | None, np.ndarray | None, bytes], ...] = ()

    def batch_body(self, i: int) -> bytes:
        """The engine's body for prompt ``i`` of a batch: the client's other fields (encoded
        once, never once per prompt) with that prompt."""
        return b'{"prompt":' + self.batch[i][2] + b"," + self.upstream[1:]

    @property
    def special_tokens(self) -> bool:
        """Whether the prompt's text is tokenized with the tokenizer's special tokens."""
        given = self.body.add_special_tokens
        return given if given is not None else not self.chat

    def json_fields(self) -> dict[str, Any]:
        """The body's fields as JSON values (what a chat template reads)."""
        return {k: _any.decode(v) for k, v in self.fields.items()}

    @property
    def max_output_tokens(self) -> int | None:
        b = self.body
        out = b.max_completion_tokens or b.max_tokens if isinstance(b, ChatBody) else b.max_tokens
        return out or None  # 0 (an echo that scores the prompt): the router's default length


def decode_openai(raw: bytes, chat: bool, max_output_tokens: int,
                  max_batch: int = 1) -> Decoded:  # fmt: skip
    try:
        body: Body = _chat.decode(raw) if chat else _completion.decode(raw)
        fields = _raw.decode(raw)
        given = fields.get("stream_options")  # its keys as sent (a raw value is not checked)
        options = _raw_options.decode(given) if given is not None else None
        pieces = (_raw_list.decode(fields["prompt"])
                  if isinstance(body, CompletionBody) and isinstance(body.prompt, list)
                  and not _token_ids(body.prompt) else [])  # fmt: skip
        if len(pieces) == 1:
            fields["prompt"] = pieces[0]  # a batch of one: the engine gets its prompt
    except (msgspec.DecodeError, RecursionError) as exc:
        raise json_error(exc, raw) from exc
    _check_common(body, max_output_tokens)
    usage = body.stream_options is not None and bool(body.stream_options.include_usage)
    if len(pieces) > 1:
        assert isinstance(body, CompletionBody) and isinstance(body.prompt, list)
        if len(pieces) > max_batch:
            raise RequestError(f"prompt is a batch of {len(pieces)} prompts, more than this "
                               f"router takes in one request ({max_batch}: "
                               "router.max_batch_prompts)", param="prompt")  # fmt: skip
        batch = tuple(
            (*_one_prompt(p, f"prompt[{i}]"), bytes(raw))
            for i, (p, raw) in enumerate(zip(body.prompt, pieces, strict=True))
        )
        others = {k: v for k, v in fields.items() if k != "prompt"}
        return Decoded(body=body, chat=chat, text=None, token_ids=None,
                       upstream=upstream_body(others, options), wants_usage=usage,
                       fields=fields, batch=batch)  # fmt: skip
    text, ids = (_chat_text(body), None) if isinstance(body, ChatBody) else _prompt(body)
    upstream = upstream_body(fields, options)
    return Decoded(body=body, chat=chat, text=text, token_ids=ids, upstream=upstream,
                   wants_usage=usage, fields=fields)  # fmt: skip


def _check_common(body: Body, max_output_tokens: int) -> None:
    if body.stream_options is not None and not body.stream:
        raise RequestError("stream_options is only allowed when stream is true",
                           param="stream_options")  # fmt: skip
    if body.use_beam_search:
        raise RequestError(
            "use_beam_search is not supported by this router: it streams every answer from the "
            "engine (to measure the first token), and beam search cannot stream",
            param="use_beam_search",
        )  # fmt: skip
    if isinstance(body, CompletionBody) and body.max_tokens == 0 and not body.echo:
        raise RequestError("max_tokens must be at least 1 (0 only with echo: true)",
                           param="max_tokens")  # fmt: skip
    if not body.stream and body.prompt_logprobs is not None:
        raise RequestError(
            "prompt_logprobs without stream is not supported by this router: it streams every "
            "answer from the engine (to measure the first token), and the engines give prompt "
            "logprobs only to a request that does not stream", param="prompt_logprobs",
        )  # fmt: skip
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise RequestError(
            "best_of other than n is not supported by this router: it streams every answer "
            "from the engine (to measure the first token), and best_of cannot stream",
            param="best_of",
        )  # fmt: skip
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(body, name, None)
        if value is not None and value > max_output_tokens:
            raise RequestError(f"{name} must be at most {max_output_tokens} "
                               "(router.max_output_tokens)", param=name)  # fmt: skip


def _token_ids(prompt: list[Any]) -> bool:
    """Whether a list prompt is one prompt's token ids (else a batch of prompts)."""
    return bool(prompt) and all(type(t) is int for t in prompt)


def _prompt(body: CompletionBody) -> tuple[str | None, np.ndarray | None]:
    prompt: str | list[Any] = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        return _one_prompt(prompt[0], "prompt")  # a batch of one: a string or token ids
    if isinstance(prompt, list) and not prompt:
        raise RequestError("prompt must not be empty", param="prompt")
    return _one_prompt(prompt, "prompt")


def _one_prompt(prompt: Any, param: str) -> tuple[str | None, np.ndarray | None]:
    """One prompt of a request (``param`` names it): a non-empty text or token-id list."""
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError(f"{param} must not be empty", param=param)
        return prompt, None
    if isinstance(prompt, list) and _token_ids(prompt):
        return None, np.asarray(prompt, dtype=np.uint32)
    if isinstance(prompt, list) and not prompt:
        raise RequestError(f"{param} must not be empty", param=param)
    raise RequestError(f"{param} must be a string or a list of token ids (a batch is a list "
                       "of such prompts)", param=param)  # fmt: skip


def _chat_text(body: ChatBody) -> str:
    """The transcript the engine's template makes of the messages: their text parts (other
    parts — images, audio — go to the engine as sent and carry no text here)."""

    def text(i: int, content: str | list[ContentPart | str] | None) -> str:
        if content is None or isinstance(content, str):
            return content or ""
        for j, part in enumerate(content):
            if isinstance(part, ContentPart) and part.type == "text" and part.text is None:
                where = f"messages[{i}].content[{j}].text"
                raise RequestError(f"{where} is required (a text part's text)", param=where)
        return "".join(p if isinstance(p, str) else p.text or "" for p in content)

    prompt = body.add_generation_prompt is not False and not body.continue_final_message
    return transcript(((m.role, text(i, m.content)) for i, m in enumerate(body.messages)),
                      generation_prompt=prompt)  # fmt: skip


def upstream_body(fields: dict[str, msgspec.Raw],
                  options: dict[str, msgspec.Raw] | None = None) -> bytes:  # fmt: skip
    """The client's fields, untouched, minus foretoken's own; streaming, with usage asked
    for (the client's other ``stream_options`` keys kept as sent)."""
    out: dict[str, Any] = {k: v for k, v in fields.items() if k not in FORETOKEN_FIELDS}
    out["stream"] = _STREAM_ON
    out["stream_options"] = (options or {}) | {"include_usage": _STREAM_ON}
    return _encoder.encode(out)


def tool_list(value: Any) -> list[Any] | None:
    """A request's ``tools``: None when it gives none (absent or empty), else the list (a
    400 when it is not one); each API checks its items."""
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        raise RequestError("tools must be a list", param="tools")
    return value
