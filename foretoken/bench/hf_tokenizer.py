"""A Hugging Face tokenizer directory that counts tokens as the built-in tokenizer does, for
benchmark tools that need one offline (aiperf, guidellm: ``--tokenizer DIR``).

The built-in tokenizer's ids are hashes, so no vocabulary reproduces them; what a benchmark
tool needs of a tokenizer is the *count* (prompt lengths it generates, output tokens it
measures). This one splits text into the built-in tokenizer's pieces (optional whitespace,
then a word run or one other character) with a ``Split`` pre-tokenizer and maps each piece
to one id of a word-level vocabulary (unknown pieces to ``UNK``), so a text has as many
tokens here as there (but for trailing whitespace, one piece more here): the simulated
engines' output (`` t123`` per token) counts exactly. The other way too: a tool that makes
its prompts by decoding ids (aiperf samples ids of a corpus) gets a text of as many built-in
tokens as ids, because every entry of the vocabulary, ``UNK`` included, is one space-led word.
``python -m foretoken.bench.hf_tokenizer DIR`` writes ``tokenizer.json`` and
``tokenizer_config.json`` there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

PIECE = r"\s*\w+|\s*[^\w\s]"
UNK = " unk"  # a word of its own when decoded, so that decoded ids count as they are
_COMMON = ("the of and a to in is you that it he was for on are as with his they I at be this "
         "have from or one had by word but not what all were we when your can said there use "
         "an each which she do how their if will up other about out many then them these so "
         "some her would make like him into time has look two more write go see number no way "
         "could people my than first water been call who oil its now find long down day did "
         "get come made may part")  # fmt: skip
WORDS = _COMMON.split(" ")


def build() -> Tokenizer:
    vocab = {UNK: 0, "<|endoftext|>": 1}
    for word in WORDS:  # space-led only: fused, any sequence of them is that many words
        vocab.setdefault(" " + word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PIECE), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


def write_dir(path: Path) -> Path:
    """``tokenizer.json`` + ``tokenizer_config.json`` (a fast tokenizer for transformers)."""
    path.mkdir(parents=True, exist_ok=True)
    build().save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": UNK,
              "eos_token": "<|endoftext|>", "model_max_length": 1 << 20,
              "clean_up_tokenization_spaces": False}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path


if __name__ == "__main__":
    print(write_dir(Path(sys.argv[1])))
