"""The tokenizer directory shipped to benchmark tools counts tokens as the built-in tokenizer
does (trailing whitespace aside), and loads as a transformers-style directory would."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer

from foretoken.bench.hf_tokenizer import build, write_dir
from foretoken.core.tokenizer import SimTokenizer

texts = st.text(st.sampled_from(list(" \n\tab_1.,é中<|>t")), max_size=80).map(str.rstrip)


@given(texts)
def test_counts_match_the_builtin_tokenizer(text: str) -> None:
    assert len(build().encode(text, add_special_tokens=False).ids) == len(
        SimTokenizer().encode(text)
    )


@given(st.lists(st.integers(0, 10_000), max_size=60))
def test_decoded_ids_count_as_many_builtin_tokens(ids: list[int]) -> None:
    """What aiperf does: ids sampled from its corpus's encoding, decoded into the prompt."""
    tok = build()
    ids = [i % tok.get_vocab_size() for i in ids if i % tok.get_vocab_size() != 1]  # not EOS
    text = tok.decode(ids, skip_special_tokens=False)
    assert len(SimTokenizer().encode(text)) == len(ids)


def test_the_directory_loads(tmp_path: Path) -> None:
    path = write_dir(tmp_path / "tok")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert len(tok.encode(" t12 t13 t14", add_special_tokens=False).ids) == 3
    config = json.loads((path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
