"""A built-in deterministic tokenizer for the simulated fleet (and the router in front of it).

Words and punctuation map to stable ids through a hash, so the same text always gives the
same tokens on every process and machine; no vocabulary file is needed. Real deployments
use a Hugging Face ``tokenizer.json`` in the router instead.
"""

from __future__ import annotations

import re

import xxhash

DEFAULT_VOCAB_SIZE = 32000
RESERVED_IDS = 16  # ids below this are never produced for text
_PIECE = re.compile(r"\s*\w+|\s*[^\w\s]")


class SimTokenizer:
    def __init__(self, vocab_size: int = DEFAULT_VOCAB_SIZE) -> None:
        if vocab_size <= RESERVED_IDS:
            raise ValueError(f"vocab_size must be > {RESERVED_IDS}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        span = self.vocab_size - RESERVED_IDS
        return [
            RESERVED_IDS + xxhash.xxh3_64_intdigest(piece.encode()) % span
            for piece in _PIECE.findall(text)
        ]

    def decode_one(self, token_id: int) -> str:
        """A printable stand-in for a generated token (the simulator generates no text)."""
        return f" t{token_id}"


def chat_to_text(messages: list[dict[str, object]]) -> str:
    """A chat transcript flattened the way a chat template would, deterministically."""
    parts = []
    for message in messages:
        content = message.get("content", "")
        if isinstance(content, list):  # OpenAI content parts
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"<|{message.get('role', 'user')}|> {content}")
    return "\n".join(parts) + "\n<|assistant|>"
