"""Chats tokenized as the engine tokenizes them: the model's chat template rendered as vLLM
renders it (Hugging Face's Jinja environment, vLLM's message shapes), found where vLLM finds
it, and the completion prompt's special tokens added as the engine adds them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from foretoken.adapters.http.chat_template import ChatTemplate, ChatTemplateError
from foretoken.adapters.http.router.anthropic import decode_messages
from foretoken.adapters.http.router.requests import RequestError, decode_openai
from foretoken.adapters.http.tokenizers import Tokenizers

# ChatML (Qwen's and many others' shape), written over several lines: trim_blocks and
# lstrip_blocks must make the newlines and indents of the block tags vanish.
CHATML = """{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are helpful.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}
{% endif %}"""
LLAMA = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
PARTS = (  # a template that walks a message's content parts itself (vLLM: "openai" format)
    "{% for m in messages %}[{{ m.role }}]{% if m.content is string %}{{ m.content }}"
    "{% else %}{% for part in m['content'] %}<{{ part.type }}:{{ part.text }}>{% endfor %}"
    "{% endif %}{% endfor %}"
)
TOOLS = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}"
    "{{ m.role }}: {{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    " CALL {{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}{% endif %}"
    "{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
)
SPECIAL = ["<s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>"]  # fmt: skip


def _model_dir(tmp_path: Path, template: Any = None, *, bos: bool = True) -> Path:
    """A model directory: tokenizer.json (words, the specials, a BOS post-processor) and a
    tokenizer_config.json with ``template`` (if any) and the BOS as a special token."""
    vocab = {"[UNK]": 0, **{t: i + 1 for i, t in enumerate(SPECIAL)}}
    words = ["system", "you", "are", "helpful", "hello", "there", "how", "user", "assistant"]
    for word in words:
        vocab[word] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
            ("<s>", vocab["<s>"])])  # fmt: skip
    tmp_path.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp_path / "tokenizer.json"))
    config: dict[str, Any] = {"bos_token": {"content": "<s>", "special": True},
                              "eos_token": "<|eot_id|>"}  # fmt: skip
    if template is not None:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_chatml_renders_as_the_engine_renders_it() -> None:
    t = ChatTemplate(CHATML)
    msgs = [{"role": "user", "content": "hello there"}]
    assert t.render(msgs) == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert t.render(msgs, add_generation_prompt=False).endswith("hello there<|im_end|>\n")
    # a request's chat_template_kwargs reach the template (Qwen3's enable_thinking)
    off = t.render(msgs, kwargs={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_special_tokens_of_the_config_are_variables_and_roles_are_checked(tmp_path: Path) -> None:
    t = ChatTemplate.load(None, _model_dir(tmp_path, LLAMA) / "tokenizer.json")
    assert t is not None and t.special["bos_token"] == "<s>"
    text = t.render([{"role": "user", "content": " hello "}])
    assert text == ("<s><|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")  # fmt: skip
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_content_parts_are_joined_by_newlines_unless_the_template_walks_them() -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "image_url", "image_url": {"url": "x"}},
             {"type": "text", "text": "two"}]  # fmt: skip
    msgs = [{"role": "user", "content": parts}]
    assert ChatTemplate(CHATML).content_format == "string"
    assert "user\none\ntwo<|im_end|>" in ChatTemplate(CHATML).render(msgs)
    walker = ChatTemplate(PARTS)
    assert walker.content_format == "openai"
    # as vLLM: the parts as given, a media part bare, a string one text part, null none
    assert walker.render(msgs) == "[user]<text:one><image:><text:two>"
    assert walker.render([{"role": "user", "content": "plain"}]) == "[user]<text:plain>"
    assert walker.render([{"role": "user", "content": None}]) == "[user]"
    # empty text parts skipped, a refusal part is text
    odd = [{"type": "text", "text": "a"}, {"type": "text", "text": ""},
           {"type": "refusal", "refusal": "no"}, {"type": "text", "text": None}]  # fmt: skip
    assert "user\na\nno<|im_end|>" in ChatTemplate(CHATML).render([{"role": "user",
                                                                     "content": odd}])  # fmt: skip


@pytest.mark.parametrize(("template", "expected"), [
    ("{% for m in messages %}{% for p in m.content %}{% endfor %}{% endfor %}", "openai"),
    ("{% set ms = messages[1:] %}{% for m in ms %}{% for p in m['content'] %}{% endfor %}"
     "{% endfor %}", "openai"),
    ("{% for m in messages | reverse %}{% for p in m.content[1:] %}{% endfor %}{% endfor %}",
     "openai"),
    ("{% set first = messages[0] %}{% for p in first['content'] %}{% endfor %}", "string"),
    ("{% macro f(message) %}{% for p in message.content %}{% endfor %}{% endmacro %}", "string"),
    (CHATML, "string"),
])  # fmt: skip
def test_the_content_format_is_detected_as_vllm_detects_it(template: str, expected: str) -> None:
    assert ChatTemplate(template).content_format == expected


def test_tool_calls_arrive_with_parsed_arguments_and_tools_are_passed() -> None:
    t = ChatTemplate(TOOLS)
    call = {"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    msgs = [{"role": "user", "content": "hi", "tool_calls": []},  # not a user's: dropped
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "cold", "tool_call_id": "c1",
             "extra": "dropped"}]  # fmt: skip
    # vLLM's tool shape: the declared keys first, description and parameters null if absent
    tools = [{"function": {"strict": True, "name": "weather", "description": "été"},
              "type": "function"}]  # fmt: skip
    text = t.render(msgs, tools=tools, add_generation_prompt=False)
    assert text.splitlines() == [
        'TOOLS [{"type": "function", "function": {"name": "weather", "description": "été", '
        '"parameters": null, "strict": true}}]',
        "user: hi", "assistant:  CALL weather(Oslo)", "tool: cold (for c1)",
    ]  # fmt: skip


def test_tool_call_arguments_empty_become_an_object_and_bad_ones_are_refused() -> None:
    t = ChatTemplate("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                     "{{ c.function.arguments | tojson }};{% endfor %}{% endfor %}")  # fmt: skip
    calls = [{"function": {"name": "f", "arguments": ""}},
             {"function": {"name": "g", "arguments": "[1, 2]"}},
             {"function": {"name": "h"}}]  # fmt: skip
    msgs = [{"role": "assistant", "content": None, "tool_calls": calls}]
    assert t.render(msgs) == "{};[1, 2];{};"
    bad = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]
    with pytest.raises(ChatTemplateError, match="not JSON"):
        t.render(bad)


def test_tool_call_arguments_too_deep_or_with_half_a_character_are_refused() -> None:
    """Arguments nested deeper than json.loads goes, or holding a lone surrogate escape
    (valid JSON text whose string no tokenizer takes), are the request's fault: a clear
    refusal, not a RecursionError or a string the tokenizer raises on after rendering."""
    t = ChatTemplate("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                     "{{ c.function.arguments | tojson }};{% endfor %}{% endfor %}")  # fmt: skip

    def calling(arguments: str) -> list[dict[str, Any]]:
        call = {"function": {"name": "f", "arguments": arguments}}
        return [{"role": "assistant", "content": None, "tool_calls": [call]}]

    with pytest.raises(ChatTemplateError, match="nested too deeply"):
        t.render(calling("[" * 100_000 + "]" * 100_000))
    for half in ('{"city": "Paris \\ud83d"}', '{"\\uDC00": 1}', '[["\\ud800x"]]'):
        with pytest.raises(ChatTemplateError, match="lone UTF-16 surrogate"):
            t.render(calling(half))
    # a whole character (a pair), an escaped backslash before "ud": text as any other
    assert t.render(calling('{"c": "\\ud83d\\ude00", "p": "\\\\ud83d"}')) == (
        '{"c": "\U0001f600", "p": "\\\\ud83d"};'
    )


def test_reasoning_reaches_the_template_as_vllm_passes_it() -> None:
    t = ChatTemplate("{% for m in messages %}[{{ m.reasoning_content }}|{{ m.reasoning }}]"
                     "{% endfor %}")  # fmt: skip
    msgs = [{"role": "assistant", "content": "x", "reasoning": "why"},
            {"role": "assistant", "content": "y", "reasoning_content": "dropped"},
            {"role": "user", "content": "z", "reasoning": "not a user's"}]  # fmt: skip
    assert t.render(msgs) == "[why|why][|][|]"


def test_named_templates_and_kwargs_that_override(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m")
    (model / "chat_template.jinja").write_text("D{{ add_generation_prompt }}")
    (model / "additional_chat_templates").mkdir()
    (model / "additional_chat_templates" / "tool_use.jinja").write_text("T{{ tools | length }}")
    t = ChatTemplate.load(None, model / "tokenizer.json")
    assert t is not None
    assert t.render([]) == "DTrue"
    assert t.render([], tools=[]) == "T0"  # tools given, even none: the tool_use template
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert t.render([], tools=tools) == "T1"
    # chat_template_kwargs come last, as vLLM passes them
    assert t.render([], kwargs={"add_generation_prompt": False}) == "DFalse"
    with pytest.raises(ChatTemplateError, match="may not set 'chat_template'"):
        t.render([], kwargs={"chat_template": "x"})


def test_continue_final_message_cuts_after_the_last_content() -> None:
    t = ChatTemplate(CHATML)
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "how"}]
    text = t.render(msgs, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nhow")
    # an empty final message: the text ends where it would have begun (transformers 4.57)
    msgs[-1]["content"] = ""
    text = t.render(msgs, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("hello<|im_end|>\n<|im_start|>assistant\n")
    # a template that trims the text: the whitespace before the cut goes too
    llama = ChatTemplate(LLAMA, {"bos_token": "<s>"})
    msgs[-1]["content"] = " Sure "
    text = llama.render(msgs, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\nSure")
    with pytest.raises(ChatTemplateError, match="cannot both be true"):
        t.render(msgs, add_generation_prompt=True, continue_final_message=True)


def test_the_sandbox_holds_and_bad_templates_are_clear() -> None:
    with pytest.raises(ChatTemplateError, match="refused"):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render([])
    with pytest.raises(ChatTemplateError, match="not a valid Jinja template"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="every message must be an object"):
        ChatTemplate(CHATML).render(["hello"])


def test_where_the_template_is_found(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "model", [{"name": "tool_use", "template": "T"},
                                            {"name": "default", "template": "D"}])  # fmt: skip
    found = ChatTemplate.load(None, model / "tokenizer.json")
    assert found is not None and found.render([]) == "D"
    (model / "chat_template.jinja").write_text("J")  # a newer layout takes precedence
    found = ChatTemplate.load(None, model / "tokenizer.json")
    assert found is not None and found.render([]) == "J"
    given = tmp_path / "mine.jinja"
    given.write_text("G{{ bos_token }}")
    found = ChatTemplate.load(given, model / "tokenizer.json")
    assert found is not None and found.render([]) == "G<s>"
    plain = _model_dir(tmp_path / "plain")  # no template anywhere
    assert ChatTemplate.load(None, plain / "tokenizer.json") is None
    lone = tmp_path / "model" / "tiny.tokenizer.json"  # not a model directory's tokenizer
    lone.write_bytes((model / "tokenizer.json").read_bytes())
    assert ChatTemplate.load(None, lone) is None
    broken = tmp_path / "broken.json"
    broken.write_text('{"no": "template"}')
    with pytest.raises(ChatTemplateError, match="holds no chat_template"):
        ChatTemplate.load(broken, None)


def _ids(toks: Tokenizers, model: str, text: str, special: bool) -> list[int]:
    return asyncio.run(toks.encode(model, text, special=special)).tolist()


def test_router_ids_of_a_chat_are_the_rendered_template_without_a_second_bos(
    tmp_path: Path,
) -> None:
    model = _model_dir(tmp_path, LLAMA)
    toks = Tokenizers({"llama": str(model / "tokenizer.json")})
    hf = Tokenizer.from_file(str(model / "tokenizer.json"))
    raw = msgspec.json.encode({"model": "llama", "messages": [
        {"role": "user", "content": "hello there"}]})  # fmt: skip
    d = decode_openai(raw, chat=True, max_output_tokens=100)
    text = asyncio.run(toks.chat_text("llama", d.text or "", d.json_fields, len(raw)))
    assert text.startswith("<s><|start_header_id|>user")
    ids = _ids(toks, "llama", text, d.special_tokens)
    assert ids == hf.encode(text, add_special_tokens=False).ids and ids.count(1) == 1
    # a completion's text gets the BOS the engine adds (vLLM's add_special_tokens default)
    c = decode_openai(b'{"model":"llama","prompt":"hello there"}', chat=False,
                      max_output_tokens=100)  # fmt: skip
    assert c.special_tokens and _ids(toks, "llama", "hello there", True)[0] == 1
    c = decode_openai(b'{"model":"llama","prompt":"hello","add_special_tokens":false}',
                      chat=False, max_output_tokens=100)  # fmt: skip
    assert not c.special_tokens and b"add_special_tokens" in c.upstream
    # a conversation the template refuses is the engine's 400, before routing
    bad = msgspec.json.encode({"model": "llama", "messages": [
        {"role": "assistant", "content": "x"}]})  # fmt: skip
    d = decode_openai(bad, chat=True, max_output_tokens=100)
    with pytest.raises(RequestError, match="roles must alternate") as err:
        asyncio.run(toks.chat_text("llama", d.text or "", d.json_fields, len(bad)))
    assert err.value.status == 400 and err.value.param == "messages"


def test_anthropic_messages_render_through_the_same_template(tmp_path: Path) -> None:
    toks = Tokenizers({"q": str(_model_dir(tmp_path, CHATML) / "tokenizer.json")})
    raw = msgspec.json.encode({"model": "q", "max_tokens": 5, "system": "you are",
                               "messages": [{"role": "user", "content": "hello"},
                                            {"role": "assistant", "content": "how"}]})  # fmt: skip
    _, transcript, _, chat = decode_messages(raw)
    text = asyncio.run(toks.chat_text("q", transcript, lambda: chat, len(raw)))
    assert text == ("<|im_start|>system\nyou are<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
                    "<|im_start|>assistant\nhow")  # a prefill, continued  # fmt: skip


def test_a_model_directory_stands_for_its_tokenizer_json(tmp_path: Path) -> None:
    toks = Tokenizers({"q": str(_model_dir(tmp_path, CHATML))})  # the directory itself
    assert toks.template("q") is not None
    assert _ids(toks, "q", "hello there", True)[0] == 1  # its tokenizer, with its BOS


def test_models_without_a_template_keep_the_built_in_transcript(tmp_path: Path) -> None:
    toks = Tokenizers({"plain": str(_model_dir(tmp_path) / "tokenizer.json")})
    assert toks.template("plain") is None and toks.template("sim") is None
    got = asyncio.run(toks.chat_text("plain", "TRANSCRIPT", lambda: {}, 10))
    assert got == "TRANSCRIPT"
