"""A model's chat template, rendered as the engine renders it, so that the router's token
ids of a chat are the engine's (the cache index hashes them: one token off at the start of a
prompt and no block of it ever matches what the engine stored).

vLLM and SGLang turn ``messages`` into a prompt with the model's Jinja chat template (the
``chat_template`` of its ``tokenizer_config.json``, a ``chat_template.jinja`` beside it, or
one given at start-up), then tokenize that text *without* adding special tokens (the
template writes the BOS itself). This module does what they do, with what the router has:

- the template from the engines file's ``chat_template`` (a file), else from the directory
  of the model's ``tokenizer.json`` (``chat_template.jinja``, ``chat_template.json``, or the
  ``chat_template`` of ``tokenizer_config.json``; of several named templates the
  ``default``), with that file's special tokens (``bos_token``, ``eos_token``, …) as
  variables, as transformers passes them;
- Hugging Face's Jinja environment: sandboxed, ``trim_blocks`` and ``lstrip_blocks``, loop
  controls, a ``{% generation %}`` block (rendered as its body), ``tojson`` keeping
  non-ASCII text, ``raise_exception`` and ``strftime_now``;
- the messages as vLLM hands them over: ``role``, ``content``, and ``name``,
  ``tool_calls`` (their JSON ``arguments`` parsed into objects), ``tool_call_id`` and
  ``reasoning_content`` when present; a content of parts becomes its text parts joined by
  newlines, unless the template loops over a message's content itself (vLLM's "openai"
  content format, detected the same way: a ``for`` over ``message['content']``), which then
  gets the parts;
- ``add_generation_prompt`` (default true), ``continue_final_message`` (the text is cut
  after the last message's content), ``tools``, ``documents`` and the request's
  ``chat_template_kwargs`` (e.g. ``enable_thinking``).

A template that refuses the conversation (``raise_exception``: roles that do not
alternate, a system message where none may be) refuses it here too: the engine would answer
400 with the same message, so the router does, before it routes. Images and audio carry no
text here; their placeholder tokens are the engine's and are not counted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Final, Literal

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

ContentFormat = Literal["string", "openai"]
# Variables a tokenizer_config.json names as its special tokens (transformers passes each).
SPECIAL_KEYS: Final = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")  # fmt: skip
MESSAGE_KEYS: Final = ("name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning")


class ChatTemplateError(ValueError):
    """A template that cannot be loaded, or that refuses a conversation."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}``: transformers marks the assistant's tokens with
    it; rendered here as its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's own attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_Generation, jinja2.ext.loopcontrols],
    )  # fmt: skip
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _named(template: Any, where: str) -> str:
    """The template of a ``chat_template`` value: a string, or named ones (the default)."""
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
    raise ChatTemplateError(f"{where}: chat_template is neither a string nor a list holding a "
                            "template named 'default'")  # fmt: skip


def _is_content_of(node: jinja2.nodes.Node, names: set[str]) -> bool:
    """``m['content']`` or ``m.content`` for a loop variable ``m`` over the messages."""
    if isinstance(node, jinja2.nodes.Getitem):
        key = node.arg
        return (isinstance(key, jinja2.nodes.Const) and key.value == "content"
                and isinstance(node.node, jinja2.nodes.Name)
                and node.node.name in names)  # fmt: skip
    if isinstance(node, jinja2.nodes.Getattr):
        return (node.attr == "content" and isinstance(node.node, jinja2.nodes.Name)
                and node.node.name in names)  # fmt: skip
    if isinstance(node, jinja2.nodes.Filter):  # e.g. message['content'] | selectattr(...)
        return node.node is not None and _is_content_of(node.node, names)
    return False


def _message_names(ast: jinja2.nodes.Template) -> Iterator[str]:
    """Names bound to one message: ``for m in messages`` and ``{% set m = messages[i] %}``."""
    for loop in ast.find_all(jinja2.nodes.For):
        it: jinja2.nodes.Node | None = loop.iter
        while isinstance(it, jinja2.nodes.Filter | jinja2.nodes.Getitem):  # messages[1:] | …
            it = it.node
        if (isinstance(it, jinja2.nodes.Name) and it.name in ("messages", "loop_messages")
                and isinstance(loop.target, jinja2.nodes.Name)):  # fmt: skip
            yield loop.target.name
    for assign in ast.find_all(jinja2.nodes.Assign):
        value = assign.node
        if (isinstance(value, jinja2.nodes.Getitem) and isinstance(value.node, jinja2.nodes.Name)
                and value.node.name in ("messages", "loop_messages")
                and isinstance(assign.target, jinja2.nodes.Name)):  # fmt: skip
            yield assign.target.name


def detect_content_format(env: jinja2.Environment, source: str) -> ContentFormat:
    """ "openai" when the template loops over a message's content parts itself."""
    try:
        ast = env.parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    names = set(_message_names(ast)) | {"message", "msg", "m"}
    for loop in ast.find_all(jinja2.nodes.For):
        if _is_content_of(loop.iter, names):
            return "openai"
    return "string"


class ChatTemplate:
    """One model's template (module doc)."""

    def __init__(self, source: str, special: Mapping[str, str] | None = None,
                 where: str = "chat template") -> None:  # fmt: skip
        self._env = _environment()
        try:
            self._template = self._env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"{where}: not a valid Jinja template: {exc}") from exc
        self.special = dict(special or {})
        self.content_format = detect_content_format(self._env, source)
        self.where = where

    @classmethod
    def load(cls, template_path: str | Path | None,
             tokenizer_path: str | Path | None) -> ChatTemplate | None:  # fmt: skip
        """The template given (a Jinja file, or a JSON file holding ``chat_template``), else
        the one beside the tokenizer.json; None when there is none."""
        tok_dir = Path(tokenizer_path).expanduser().parent if tokenizer_path else None
        special = _special_tokens(tok_dir / "tokenizer_config.json") if tok_dir else {}
        if template_path is not None:
            path = Path(template_path).expanduser()
            return cls(_read_template(path) or "", special, str(path))
        if tok_dir is None or Path(str(tokenizer_path)).name != "tokenizer.json":
            return None  # a lone tokenizer file: its directory is not a model's
        for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
            path = tok_dir / name
            if path.is_file():
                source = _read_template(path, required=name != "tokenizer_config.json")
                if source is not None:
                    return cls(source, special, str(path))
        return None

    def render(self, messages: Sequence[Any], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: Any = None, documents: Any = None,
               kwargs: Mapping[str, Any] | None = None) -> str:  # fmt: skip
        """The prompt text of ``messages`` (OpenAI chat messages, as decoded from JSON)."""
        if add_generation_prompt and continue_final_message:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot "
                                    "both be true")  # fmt: skip
        msgs = [self._message(m) for m in messages]
        variables: dict[str, Any] = {**self.special, **(kwargs or {})}
        variables.update(messages=msgs, tools=tools, documents=documents,
                         add_generation_prompt=add_generation_prompt)  # fmt: skip
        try:
            text = self._template.render(**variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError,
                RecursionError) as exc:  # fmt: skip
            raise ChatTemplateError(f"the chat template failed on the messages: "
                                    f"{type(exc).__name__}: {exc}") from exc  # fmt: skip
        if continue_final_message and msgs:
            text = _cut_after(text, msgs[-1].get("content"))
        return text

    def _message(self, m: Any) -> dict[str, Any]:
        if not isinstance(m, Mapping):
            raise ChatTemplateError("every message must be an object")
        out: dict[str, Any] = {"role": m.get("role"), "content": self._content(m.get("content"))}
        for key in MESSAGE_KEYS:
            if m.get(key) is not None:
                out[key] = m[key]
        if isinstance(out.get("tool_calls"), list):
            out["tool_calls"] = [_parsed_arguments(c) for c in out["tool_calls"]]
        return out

    def _content(self, content: Any) -> Any:
        if content is None or isinstance(content, str):
            return content if content is not None else ""
        parts = [p for p in content if isinstance(p, Mapping)] if isinstance(content, list) else []
        texts = [str(p.get("text") or "") for p in parts if p.get("type") == "text"]
        if self.content_format == "openai":
            return [{"type": "text", "text": t} for t in texts]
        return "\n".join(texts)


def _parsed_arguments(call: Any) -> Any:
    """A tool call whose ``function.arguments`` JSON string is an object, as vLLM gives it."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            return call
        if isinstance(parsed, dict):
            return {**call, "function": {**call["function"], "arguments": parsed}}
    return call


def _cut_after(text: str, content: Any) -> str:
    """The rendered text up to the end of the final message's content (what transformers
    does for ``continue_final_message``)."""
    if isinstance(content, list):
        content = next((p.get("text") for p in reversed(content) if isinstance(p, Mapping)), "")
    final = str(content or "")
    for piece in (final, final.strip()):
        if piece and piece in text:
            return text[: text.rindex(piece) + len(piece)]
    if not final.strip():
        return text
    raise ChatTemplateError("continue_final_message: the final message's content is not in "
                            "the rendered chat template")  # fmt: skip


def _read_template(path: Path, *, required: bool = True) -> str | None:
    """A template file: Jinja text, or JSON holding ``chat_template`` (tokenizer_config.json,
    chat_template.json)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"cannot read the chat template {path}: {exc}") from exc
    if path.suffix != ".json":
        return text
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ChatTemplateError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("chat_template") is None:
        if required:
            raise ChatTemplateError(f"{path} holds no chat_template")
        return None
    return _named(doc["chat_template"], str(path))


def _special_tokens(config: Path) -> dict[str, str]:
    """The special tokens of a tokenizer_config.json, as template variables."""
    try:
        doc = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    if not isinstance(doc, dict):
        return {}
    out = {}
    for key in SPECIAL_KEYS:
        text = _token_text(doc.get(key))
        if text is not None:
            out[key] = text
    return out
