"""The built-in tokenizer's fast path gives exactly the ids of its definition (a piece is
optional whitespace then a word run or one other character; id = 16 + xxh3_64(piece) mod
(vocab − 16)), for any text, whole or in slices; the chat transcript is one function for the
simulated engines (message dicts) and the router."""

from __future__ import annotations

import re

import numpy as np
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from foretoken.core.tokenizer import SimTokenizer, chat_to_text, transcript

DEFINITION = re.compile(r"\s*\w+|\s*[^\w\s]")
texts = st.text(st.characters(codec="utf-8"), max_size=200) | st.text(
    st.sampled_from(list(" \t\n\x1c\x1f\x85\u00a0\u2003ab_1.,é中")), max_size=200
)


def by_definition(text: str, vocab: int = 32000) -> list[int]:
    return [
        16 + xxhash.xxh3_64_intdigest(p.encode()) % (vocab - 16) for p in DEFINITION.findall(text)
    ]


@given(texts)
def test_the_fast_path_gives_the_defined_ids(text: str) -> None:
    tok = SimTokenizer()
    assert tok.encode(text) == by_definition(text)
    assert tok.encode_array(text).dtype == np.uint32


ascii_texts = st.text(st.characters(max_codepoint=127), max_size=300) | st.text(
    st.sampled_from(list(" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x00\x7fab_Z9.,!")), max_size=300
)


@given(ascii_texts, st.sampled_from([17, 100, 32000, 2**31]))
def test_the_native_split_and_the_bytes_pattern_give_the_defined_ids(text: str, vocab: int) -> None:
    native, reference = SimTokenizer(vocab), SimTokenizer(vocab, native=False)
    assert native._native is not None  # the crate is built: ASCII text goes through it
    want = by_definition(text, vocab)
    assert native.encode(text) == want
    assert reference.encode(text) == want
    assert native.encode_array(text).dtype == np.uint32


@given(texts, st.integers(1, 50))
def test_slices_concatenate_to_the_whole(text: str, size: int) -> None:
    tok = SimTokenizer()
    parts = list(tok.encode_slices(text, size))
    joined = np.concatenate(parts).tolist() if parts else []
    assert joined == tok.encode(text)


def test_a_transcript_is_the_same_from_dicts_and_pairs() -> None:
    messages = [
        {"role": "system", "content": "s"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image"},
                {"type": "text", "text": "b"},
            ],
        },
        {"role": "assistant", "content": None},
    ]
    assert chat_to_text(messages) == transcript(
        [("system", "s"), ("user", "ab"), ("assistant", "")]
    )
    assert chat_to_text(messages).endswith("\n<|assistant|>")
