"""Tokenizers per model: a Hugging Face ``tokenizer.json`` when the operator has one, the
built-in deterministic tokenizer otherwise (the simulated fleet uses it too). Requests given
as token ids pass through untouched."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from foretoken.core.tokenizer import SimTokenizer


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library (no download, no hub)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HF

        try:
            self._tok = _HF.from_file(str(path))
        except Exception as exc:  # the library raises plain Exceptions for bad files
            raise ValueError(f"cannot load tokenizer {path}: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)


class Tokenizers:
    """Model name → tokenizer, from ``{model: path}``; unknown models use the built-in one."""

    def __init__(self, paths: dict[str, str] | None = None) -> None:
        self._default = SimTokenizer()
        self._by_model: dict[str, Tokenizer] = {
            model: HFTokenizer(path) for model, path in (paths or {}).items()
        }

    def for_model(self, model: str) -> Tokenizer:
        return self._by_model.get(model, self._default)
