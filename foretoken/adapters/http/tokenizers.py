"""Tokenizers per model: a Hugging Face ``tokenizer.json`` when the operator has one, the
built-in deterministic tokenizer otherwise (the simulated fleet uses it too). Requests given
as token ids pass through untouched.

Text is tokenized as the engines do: a completion's prompt with the tokenizer's special
tokens (its BOS: vLLM's and SGLang's default, ``add_special_tokens`` in the request says
otherwise), a chat's rendered template without them (the template writes them). A chat is
rendered with the model's chat template when there is one (``chat_template.py``), else as
the built-in transcript the simulated engines use.

Both give ``uint32`` arrays (the route RPC packs them as they are). Long texts are tokenized
in a thread (:meth:`Tokenizers.encode`), so that a big prompt never holds the router's event
loop: the HF tokenizer is native, and the built-in one spends most of its time in the regex
engine and in ``map`` over the C hash.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from foretoken.adapters.http.chat_template import ChatTemplate, ChatTemplateError
from foretoken.adapters.http.router.requests import RequestError
from foretoken.core.tokenizer import SimTokenizer

if TYPE_CHECKING:
    from foretoken.adapters.engines.engines_file import EngineConfig

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    def encode_array(self, text: str, special: bool = False) -> np.ndarray: ...


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library (no download, no hub)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HF

        path = tokenizer_file(path)
        try:
            self._tok = _HF.from_file(str(path))
        except Exception as exc:  # the library raises plain Exceptions for bad files
            raise ValueError(f"cannot load tokenizer {path}: {exc}") from exc

    def encode_array(self, text: str, special: bool = False) -> np.ndarray:
        """The ids of ``text``; with ``special``, the tokenizer's own special tokens added
        (its post-processor: a BOS, say)."""
        ids = self._tok.encode(text, add_special_tokens=special).ids
        return np.asarray(ids, dtype=np.uint32)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)


def _sliced(tokenizer: SimTokenizer, text: str, chars: int, limit: int | None) -> np.ndarray:
    parts, count = [], 0
    for part in tokenizer.encode_slices(text, chars):
        parts.append(part)
        count += len(part)
        if limit is not None and count > limit:
            break
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)


class Tokenizers:
    """Model name → tokenizer, from ``{model: path}``; unknown models use the built-in one.
    Texts of at least ``off_loop_chars`` characters are tokenized in a worker thread."""

    def __init__(self, paths: dict[str, str] | None = None, off_loop_chars: int = 32_768,
                 templates: Mapping[str, str] | None = None) -> None:  # fmt: skip
        self._default = SimTokenizer()
        paths, templates = paths or {}, templates or {}
        self._by_model: dict[str, Tokenizer] = {
            model: HFTokenizer(path) for model, path in paths.items()
        }
        self._templates: dict[str, ChatTemplate] = {}
        for model in set(paths) | set(templates):
            try:
                given = paths.get(model)
                template = ChatTemplate.load(templates.get(model),
                                             tokenizer_file(given) if given else None)  # fmt: skip
            except ChatTemplateError as exc:
                raise ValueError(f"model {model}: {exc}") from exc
            if template is not None:
                self._templates[model] = template
            else:
                log.warning("model %s: no chat template (none given, none beside its "
                            "tokenizer.json): its chats are counted on a generic transcript, "
                            "so their cache credits may miss", model)  # fmt: skip
        self.off_loop_chars = off_loop_chars

    @classmethod
    def of(cls, engines: list[EngineConfig], tokenizers: Mapping[str, str],
           templates: Mapping[str, str], off_loop_chars: int) -> Tokenizers:  # fmt: skip
        """Per model, the engines file's ``tokenizer`` and ``chat_template``, overridden by
        the settings' (``router.tokenizers``, ``router.chat_templates``)."""
        paths = {e.model: e.tokenizer for e in engines if e.tokenizer} | dict(tokenizers)
        chats = {e.model: e.chat_template for e in engines if e.chat_template} | dict(templates)
        for e in engines:  # a LoRA adapter tokenizes as its base model
            for adapter in e.lora_adapters:
                if e.model in paths:
                    paths.setdefault(adapter, paths[e.model])
                if e.model in chats:
                    chats.setdefault(adapter, chats[e.model])
        return cls(paths, off_loop_chars, chats)

    def template(self, model: str) -> ChatTemplate | None:
        return self._templates.get(model)

    async def chat_text(self, model: str, transcript: str,
                        body: Callable[[], Mapping[str, Any]], size: int) -> str:  # fmt: skip
        """A chat's prompt text: ``body()`` (the chat completion body as JSON values) through
        the model's template — off the loop for a body of ``off_loop_chars`` bytes or more —
        or, for a model without one, the built-in ``transcript``. A conversation the template
        refuses is a :class:`RequestError`, as the engine's 400 would be."""
        template = self._templates.get(model)
        if template is None:
            return transcript

        def render() -> str:
            try:
                return render_request(template, body())
            except ChatTemplateError as exc:
                raise RequestError(str(exc), param="messages") from exc

        return await asyncio.to_thread(render) if size >= self.off_loop_chars else render()

    def for_model(self, model: str) -> Tokenizer:
        return self._by_model.get(model, self._default)

    async def encode(self, model: str, text: str, limit: int | None = None,
                     special: bool = False) -> np.ndarray:  # fmt: skip
        """The ids of ``text`` (with the tokenizer's special tokens when ``special``); with
        ``limit``, the built-in tokenizer may stop once it has more than that many (the
        prompt is refused anyway)."""
        tokenizer = self.for_model(model)
        if len(text) < self.off_loop_chars:
            return tokenizer.encode_array(text, special)
        if isinstance(tokenizer, SimTokenizer):
            # The regex and the hashing hold the GIL for as long as one call runs: in slices,
            # the event loop gets it back between them.
            return await asyncio.to_thread(_sliced, tokenizer, text, self.off_loop_chars, limit)
        return await asyncio.to_thread(tokenizer.encode_array, text, special)


def render_request(template: ChatTemplate, body: Mapping[str, Any]) -> str:
    """A chat completion body (vLLM's fields: ``add_generation_prompt``,
    ``continue_final_message``, ``tools``, ``documents``, ``chat_template_kwargs``) rendered."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ChatTemplateError("chat_template_kwargs must be an object")
    messages = body.get("messages")
    return template.render(
        messages if isinstance(messages, list) else [],
        add_generation_prompt=body.get("add_generation_prompt") is not False,
        continue_final_message=bool(body.get("continue_final_message")),
        tools=body.get("tools"), documents=body.get("documents"), kwargs=kwargs,
    )  # fmt: skip


def tokenizer_file(path: str | Path) -> Path:
    """A tokenizer.json, given as itself or as the model's directory holding it."""
    found = Path(path).expanduser()
    return found / "tokenizer.json" if found.is_dir() else found
