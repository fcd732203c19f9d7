"""A built-in deterministic tokenizer for the simulated fleet (and the router in front of it).

Words and punctuation map to stable ids through a hash, so the same text always gives the
same tokens on every process and machine; no vocabulary file is needed. Real deployments
use a Hugging Face ``tokenizer.json`` in the router instead.

A piece is optional whitespace followed by a run of word characters or by one other
character (``\\s*\\w+|\\s*[^\\w\\s]``); its id is ``16 + xxh3_64(utf-8 piece) mod
(vocab − 16)``. :meth:`SimTokenizer.encode_array` computes exactly these ids fast: ASCII text
is split by an equivalent bytes pattern (Python's ``str`` ``\\s`` also holds ``\\x1c–\\x1f``,
written out below), hashed by ``map`` in C and reduced with numpy (a 32k-token prompt in
~5 ms instead of ~30 ms); other text takes the ``str`` pattern. With the native crate
built, ASCII text is split and hashed there (``foretoken_native.sim_token_ids``, ~0.3 ms
for 32k tokens, without the GIL); the bytes pattern stays as its reference
(``SimTokenizer(native=False)``; the tests hold the two equal).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import xxhash

try:  # the crate's split and hash (module doc); without it the bytes pattern, same ids
    from foretoken_native import sim_token_ids as _native_ids
except ImportError:  # pragma: no cover - the crate is built by every install path
    _native_ids = None

DEFAULT_VOCAB_SIZE = 32000
RESERVED_IDS = 16  # ids below this are never produced for text
_PIECE = re.compile(r"\s*+(?:\w++|[^\w\s])")
_ASCII_SPACE = rb"\s\x1c-\x1f"
_ASCII_PIECE = re.compile(rb"[" + _ASCII_SPACE + rb"]*+(?:\w++|[^\w" + _ASCII_SPACE + rb"])")


class SimTokenizer:
    def __init__(self, vocab_size: int = DEFAULT_VOCAB_SIZE, native: bool = True) -> None:
        if vocab_size <= RESERVED_IDS:
            raise ValueError(f"vocab_size must be > {RESERVED_IDS}")
        self.vocab_size = vocab_size
        self._span = np.uint64(vocab_size - RESERVED_IDS)
        self._native = _native_ids if native and vocab_size < 2**32 else None

    def encode_array(self, text: str, special: bool = False) -> np.ndarray:
        """The token ids as a ``uint32`` array (``special`` changes nothing: this tokenizer
        has no special tokens to add)."""
        if text.isascii():
            data = text.encode()
            if self._native is not None:
                packed = self._native(data, self.vocab_size)
                return np.frombuffer(packed, dtype="<u4").astype(np.uint32)
            pieces: Iterable[bytes] = _ASCII_PIECE.findall(data)
        else:
            pieces = map(str.encode, _PIECE.findall(text))
        hashes = np.fromiter(map(xxhash.xxh3_64_intdigest, pieces), dtype=np.uint64)
        return (hashes % self._span + np.uint64(RESERVED_IDS)).astype(np.uint32)

    def encode_slices(self, text: str, slice_chars: int) -> Iterator[np.ndarray]:
        """The ids of ``text`` in pieces of about ``slice_chars`` characters, cut where a
        whitespace follows a non-whitespace (no piece spans such a cut: a piece's whitespace
        leads it), so that their concatenation is :meth:`encode_array`. Each slice is one
        stretch of C code; between them another thread (an event loop) can run."""
        start = 0
        while start < len(text):
            end = _cut(text, start + slice_chars)
            yield self.encode_array(text[start:end])
            start = end

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.encode_array(text).tolist()
        return ids

    def decode_one(self, token_id: int) -> str:
        """A printable stand-in for a generated token (the simulator generates no text)."""
        return f" t{token_id}"


def _cut(text: str, at: int) -> int:
    """The first index ≥ ``at`` holding whitespace right after a non-whitespace (or the end)."""
    n = len(text)
    i = at
    while i < n and not (text[i].isspace() and not text[i - 1].isspace()):
        i += 1
    return min(i, n)


def transcript(turns: Iterable[tuple[str, str]], *, generation_prompt: bool = True) -> str:
    """(role, text) turns flattened the way a chat template would, deterministically; with
    the assistant's generation prompt at the end unless the last turn is to be continued
    (vLLM's ``continue_final_message``, Anthropic's assistant prefill)."""
    text = "\n".join(f"<|{role}|> {text}" for role, text in turns)
    return text + "\n<|assistant|>" if generation_prompt else text


def content_text(content: object) -> str:
    """The text of a message's content: a string, or OpenAI/Anthropic parts (their text
    parts joined; other parts carry no text); none is empty."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, Mapping))
    return str(content)


def chat_to_text(messages: Sequence[Mapping[str, object]], *,
                 generation_prompt: bool = True) -> str:  # fmt: skip
    """A chat transcript from OpenAI-style message dicts (the simulated engines' template)."""
    return transcript(
        ((str(m.get("role", "user")), content_text(m.get("content"))) for m in messages),
        generation_prompt=generation_prompt,
    )


def generation_prompt(body: Mapping[str, object]) -> bool:
    """Whether a chat body asks for the assistant's generation prompt (vLLM's and SGLang's
    ``add_generation_prompt``, default true, and ``continue_final_message``)."""
    return body.get("add_generation_prompt") is not False and not body.get("continue_final_message")
