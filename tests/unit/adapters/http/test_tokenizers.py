from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from foretoken.adapters.http.tokenizers import HFTokenizer, Tokenizers
from foretoken.core.tokenizer import SimTokenizer


def _tokenizer_json(tmp_path: Path) -> Path:
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "again": 3}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_a_tokenizer_json_is_used_for_its_model_only(tmp_path: Path) -> None:
    toks = Tokenizers({"real-model": str(_tokenizer_json(tmp_path))})
    real = toks.for_model("real-model").encode_array("hello world again nope").tolist()
    assert real == [1, 2, 3, 0]
    sim = toks.for_model("sim-model").encode_array("hello world").tolist()
    assert sim == SimTokenizer().encode("hello world") and sim != [1, 2]


def test_a_bad_tokenizer_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        HFTokenizer(bad)
