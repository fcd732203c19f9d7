"""A model's chat template, rendered as the engine renders it, so that the router's token
ids of a chat are the engine's (the cache index hashes them: one token off at the start of a
prompt and no block of it ever matches what the engine stored).

vLLM and SGLang turn ``messages`` into a prompt with the model's Jinja chat template (the
``chat_template`` of its ``tokenizer_config.json``, a ``chat_template.jinja`` beside it, or
one given at start-up), then tokenize that text *without* adding special tokens (the
template writes the BOS itself). This module does what they do (vLLM 0.12 with transformers
4.57, re-described), with what the router has:

- the template from the engines file's ``chat_template`` (a file), else from the directory
  of the model's ``tokenizer.json`` (``chat_template.jinja`` with the named templates of
  ``additional_chat_templates/``, ``chat_template.json``, or the ``chat_template`` of
  ``tokenizer_config.json``), with that file's special tokens (``bos_token``,
  ``eos_token``, …, ``additional_special_tokens``) as variables, as transformers passes them;
  of named templates, ``tool_use`` when the request has tools, else ``default``;
- Hugging Face's Jinja environment: sandboxed, ``trim_blocks`` and ``lstrip_blocks``, loop
  controls, a ``{% generation %}`` block (rendered as its body), ``tojson`` keeping
  non-ASCII text, ``raise_exception`` and ``strftime_now``;
- the messages and tools in vLLM's shapes (``chat_messages.py``), the content as a string or
  as parts by the template's content format — "openai" when the template loops over a
  message's ``content`` itself, detected on its syntax tree as vLLM does;
- ``add_generation_prompt`` (default true), ``continue_final_message`` (cut where the final
  message's text ends, transformers' tag method), ``tools``, ``documents``, and the request's
  ``chat_template_kwargs`` (e.g. ``enable_thinking``), which override the others.

A template that refuses the conversation (``raise_exception``: roles that do not
alternate, a system message where none may be) refuses it here too: the engine would answer
400 with the same message, so the router does, before it routes. Images and audio carry no
text here; their placeholder tokens are the engine's and are not counted. Not followed: a
per-request ``chat_template`` (vLLM ≥ 0.11 refuses it unless started to trust it; the
router renders the model's), ``--exclude-tools-when-tool-choice-none``, and Mistral's own
tokenizer mode (no Jinja template).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from foretoken.adapters.http.chat_messages import (
    ContentFormat,
    MessageError,
    conversation,
    tool_schemas,
)

# Variables a tokenizer_config.json names as its special tokens (transformers passes each).
SPECIAL_KEYS: Final = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")  # fmt: skip


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


def _named(template: Any, where: str) -> dict[str, str]:
    """The templates of a ``chat_template`` value: one string (``default``), or named ones."""
    if isinstance(template, str):
        return {"default": template}
    if isinstance(template, list):
        named = {str(t.get("name")): t.get("template") for t in template if isinstance(t, Mapping)}
        if named and all(isinstance(v, str) for v in named.values()):
            return {k: str(v) for k, v in named.items()}
    raise ChatTemplateError(f"{where}: chat_template is neither a string nor a list of "
                            "{name, template} objects")  # fmt: skip


def _is_elems(node: Any, name: str, key: str | None = None) -> bool:
    """``name`` (or its ``key`` item: ``name['key']``, ``name.key``), possibly sliced,
    filtered or tested — vLLM's test for where a loop's items come from."""
    while ((isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.node is not None)
           or (isinstance(node, jinja2.nodes.Getitem)
           and isinstance(node.arg, jinja2.nodes.Slice))):  # fmt: skip
        node = node.node
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.name == name
    if isinstance(node, jinja2.nodes.Getitem):
        return (isinstance(node.node, jinja2.nodes.Name) and node.node.name == name
                and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key)  # fmt: skip
    return (isinstance(node, jinja2.nodes.Getattr) and node.attr == key
            and isinstance(node.node, jinja2.nodes.Name) and node.node.name == name)  # fmt: skip


def detect_content_format(env: jinja2.Environment, source: str) -> ContentFormat:
    """ "openai" when the template loops over a message's content parts itself: names bound
    to ``messages`` (through assignments of it, sliced or filtered, transitively), loops over
    them, and a loop over such a loop variable's ``content``. Else "string"."""
    try:
        ast = env.parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    lists, queue = ["messages"], ["messages"]
    while queue:
        name = queue.pop(0)
        for assign in ast.find_all(jinja2.nodes.Assign):
            target = assign.target
            if (_is_elems(assign.node, name) and isinstance(target, jinja2.nodes.Name)
                    and target.name not in lists):  # fmt: skip
                lists.append(target.name)
                queue.append(target.name)
    items = [loop.target.name for loop in ast.find_all(jinja2.nodes.For)
             if isinstance(loop.target, jinja2.nodes.Name)
             and any(_is_elems(loop.iter, n) for n in lists)]  # fmt: skip
    for loop in ast.find_all(jinja2.nodes.For):
        if any(_is_elems(loop.iter, n, "content") for n in items):
            return "openai"
    return "string"


class ChatTemplate:
    """One model's templates (module doc): ``default``, and others by name (``tool_use``,
    chosen when a request has tools)."""

    def __init__(self, source: str | Mapping[str, str], special: Mapping[str, Any] | None = None,
                 where: str = "chat template") -> None:  # fmt: skip
        self._env = _environment()
        named = {"default": source} if isinstance(source, str) else dict(source)
        self._templates: dict[str, tuple[jinja2.Template, ContentFormat]] = {}
        for name, text in named.items():
            try:
                compiled = self._env.from_string(text)
            except jinja2.TemplateSyntaxError as exc:
                raise ChatTemplateError(f"{where}: not a valid Jinja template ({name}): "
                                        f"{exc}") from exc  # fmt: skip
            self._templates[name] = (compiled, detect_content_format(self._env, text))
        if "default" not in self._templates and len(self._templates) != 1:
            raise ChatTemplateError(f"{where}: several named chat templates and none is "
                                    "'default'")  # fmt: skip
        self.special = dict(special or {})
        self.where = where

    @property
    def content_format(self) -> ContentFormat:
        return self._choose(None)[1]

    def _choose(self, tools: Any) -> tuple[jinja2.Template, ContentFormat]:
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        return self._templates.get("default") or next(iter(self._templates.values()))

    @classmethod
    def load(cls, template_path: str | Path | None,
             tokenizer_path: str | Path | None) -> ChatTemplate | None:  # fmt: skip
        """The template given (a Jinja file, or a JSON file holding ``chat_template``), else
        the one beside the tokenizer.json (``chat_template.jinja`` with the named ones of
        ``additional_chat_templates/``, ``chat_template.json``, ``tokenizer_config.json``);
        None when there is none."""
        tok_dir = Path(tokenizer_path).expanduser().parent if tokenizer_path else None
        special = _special_tokens(tok_dir / "tokenizer_config.json") if tok_dir else {}
        if template_path is not None:
            path = Path(template_path).expanduser()
            return cls(_read_template(path) or {}, special, str(path))
        if tok_dir is None or Path(str(tokenizer_path)).name != "tokenizer.json":
            return None  # a lone tokenizer file: its directory is not a model's
        for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
            path = tok_dir / name
            if path.is_file():
                source = _read_template(path, required=name != "tokenizer_config.json")
                if source is not None:
                    if isinstance(source, str):  # chat_template.jinja, and its siblings
                        source = {**_additional(tok_dir / "additional_chat_templates"),
                                  "default": source}  # fmt: skip
                    return cls(source, special, str(path))
        return None

    def render(self, messages: Any, *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: Any = None, documents: Any = None,
               kwargs: Mapping[str, Any] | None = None) -> str:  # fmt: skip
        """The prompt text of ``messages`` (OpenAI chat messages, as decoded from JSON).
        The request's ``kwargs`` (``chat_template_kwargs``) override the other settings."""
        options: dict[str, Any] = {
            "add_generation_prompt": add_generation_prompt, "tools": tools,
            "continue_final_message": continue_final_message, "documents": documents,
            **(kwargs or {}),
        }  # fmt: skip
        for refused in ("chat_template", "tokenize"):
            if refused in options:
                raise ChatTemplateError(f"chat_template_kwargs may not set {refused!r}")
        proceed = bool(options.pop("continue_final_message"))
        if options["add_generation_prompt"] and proceed:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot "
                                    "both be true")  # fmt: skip
        template, fmt = self._choose(options["tools"])
        try:
            options["tools"] = tool_schemas(options["tools"])
            msgs = conversation(messages, fmt)
        except MessageError as exc:
            raise ChatTemplateError(str(exc)) from exc
        if proceed and msgs:
            _tag_final(msgs[-1])
        try:
            text = template.render(**{**self.special, **options, "messages": msgs})
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError,
                RecursionError) as exc:  # fmt: skip
            raise ChatTemplateError(f"the chat template failed on the messages: "
                                    f"{type(exc).__name__}: {exc}") from exc  # fmt: skip
        return _cut_at_tag(text) if proceed and msgs else text


# continue_final_message (transformers ≥ 4.57): the final message's text is rendered with
# this tag after it, and the text is cut where the tag is (the whitespace before it trimmed
# when the template trimmed what followed the text).
FINAL_TAG: Final = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final(message: dict[str, Any]) -> None:
    content = message.get("content")
    if isinstance(content, list):
        for part in reversed(content):
            if isinstance(part, dict) and "text" in part:
                part["text"] = str(part["text"]) + FINAL_TAG
                return
        raise ChatTemplateError("continue_final_message: the final message has no text")
    message["content"] = str(content or "") + FINAL_TAG


def _cut_at_tag(text: str) -> str:
    tag = FINAL_TAG.strip()
    if tag not in text:
        raise ChatTemplateError("continue_final_message: the final message does not appear in "
                                "the rendered chat template")  # fmt: skip
    at = text.rindex(tag)
    return text[:at] if text[at : at + len(FINAL_TAG)] == FINAL_TAG else text[:at].rstrip()


def _additional(directory: Path) -> dict[str, str]:
    """Named templates of an ``additional_chat_templates`` directory (``<name>.jinja``)."""
    if not directory.is_dir():
        return {}
    return {p.stem: str(_read_template(p)) for p in sorted(directory.glob("*.jinja"))}


def _read_template(path: Path, *, required: bool = True) -> str | dict[str, str] | None:
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


def _special_tokens(config: Path) -> dict[str, Any]:
    """The special tokens of a tokenizer_config.json, as template variables."""
    try:
        doc = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    if not isinstance(doc, dict):
        return {}
    out: dict[str, Any] = {}
    for key in SPECIAL_KEYS:
        text = _token_text(doc.get(key))
        if text is not None:
            out[key] = text
    extra = doc.get("additional_special_tokens")
    if isinstance(extra, list):
        out["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
    return out
