"""Tokenizers per model: a Hugging Face ``tokenizer.json`` when the operator has one, the
built-in deterministic tokenizer otherwise (the simulated fleet uses it too). Requests given
as token ids pass through untouched.

Both give ``uint32`` arrays (the route RPC packs them as they are). Long texts are tokenized
in a thread (:meth:`Tokenizers.encode`), so that a big prompt never holds the router's event
loop: the HF tokenizer is native, and the built-in one spends most of its time in the regex
engine and in ``map`` over the C hash.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Protocol

import numpy as np

from foretoken.core.tokenizer import SimTokenizer


class Tokenizer(Protocol):
    def encode_array(self, text: str) -> np.ndarray: ...


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library (no download, no hub)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HF

        try:
            self._tok = _HF.from_file(str(path))
        except Exception as exc:  # the library raises plain Exceptions for bad files
            raise ValueError(f"cannot load tokenizer {path}: {exc}") from exc

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

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

    def __init__(self, paths: dict[str, str] | None = None, off_loop_chars: int = 32_768) -> None:
        self._default = SimTokenizer()
        self._by_model: dict[str, Tokenizer] = {
            model: HFTokenizer(path) for model, path in (paths or {}).items()
        }
        self.off_loop_chars = off_loop_chars

    def for_model(self, model: str) -> Tokenizer:
        return self._by_model.get(model, self._default)

    async def encode(self, model: str, text: str, limit: int | None = None) -> np.ndarray:
        """The ids of ``text``; with ``limit``, the built-in tokenizer may stop once it has
        more than that many (the prompt is refused anyway)."""
        tokenizer = self.for_model(model)
        if len(text) < self.off_loop_chars:
            return tokenizer.encode_array(text)
        if isinstance(tokenizer, SimTokenizer):
            # The regex and the hashing hold the GIL for as long as one call runs: in slices,
            # the event loop gets it back between them.
            return await asyncio.to_thread(_sliced, tokenizer, text, self.off_loop_chars, limit)
        return await asyncio.to_thread(tokenizer.encode_array, text)
