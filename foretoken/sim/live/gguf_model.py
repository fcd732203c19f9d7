"""A tiny random-weight llama-architecture model as a GGUF file, written with the ``gguf``
package: a real model for a real llama.cpp server, with no download.

* **Vocabulary**: byte level. Token ``i`` (0..255) is byte ``i`` (GPT-2's byte-to-unicode
  spelling, ``tokenizer.ggml.model = "gpt2"``); one merge that never occurs in text (the
  format needs at least one), then BOS and EOS as control tokens; no BOS is added. So a
  prompt's token count is its UTF-8 length, and :func:`write_tokenizer_json` gives the router
  a ``tokenizer.json`` that tokenizes exactly as the engine does.
* **Size**: one layer, one 64-wide attention head and a wide (4096) feed-forward block: the
  feed-forward part gives the per-token (linear) cost, attention the quadratic one, and they
  cross near 2-3k tokens; on one core of this machine (llama.cpp's CPU backend, no flash
  attention) 512 tokens prefill in ~0.05 s, 2k in ~0.3 s, 8k in ~3 s, 16k in ~9 s.
* **Output**: random weights would often sample EOS or a byte that is not valid UTF-8 on its
  own (the server then streams nothing). One embedding dimension is held constant through
  the residual stream (the layers never write to it) and the output head reads it with a
  large weight: printable ASCII tokens are strongly preferred, so every first token is text.
  This shapes only which token comes out; the compute per token is the same as any llama.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np

BYTE_TOKENS: Final = 256
MERGE_ID: Final = 256
BOS_ID: Final = 257
EOS_ID: Final = 258
VOCAB_SIZE: Final = 259
ARCH: Final = "llama"
# The residual dimension kept constant (see module doc) and its value / the head's weight.
STEER_DIM: Final = 0
STEER_VALUE: Final = 4.0
STEER_LOGIT: Final = 8.0


@dataclass(frozen=True, slots=True)
class TinyLlamaSpec:
    """Shape of the generated model. ``context_length`` must cover the server's ``n_ctx``."""

    n_embd: int = 64
    n_layer: int = 1
    n_head: int = 1
    n_head_kv: int = 1
    n_ff: int = 4096
    context_length: int = 32768
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head or self.n_head % self.n_head_kv:
            raise ValueError("n_embd must divide by n_head, and n_head by n_head_kv")
        if min(self.n_embd, self.n_layer, self.n_ff, self.context_length) < 1:
            raise ValueError("sizes must be positive")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def stem(self) -> str:
        """A file name that changes with the shape (so cached files are never stale)."""
        return (
            f"tiny-llama-e{self.n_embd}-l{self.n_layer}-h{self.n_head}x{self.n_head_kv}"
            f"-f{self.n_ff}-c{self.context_length}-s{self.seed}"
        )


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (the byte-level BPE alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(BYTE_TOKENS):
        if b not in mapping:
            mapping[b] = chr(BYTE_TOKENS + extra)
            extra += 1
    return mapping


def _vocab() -> tuple[list[str], str]:
    chars = byte_to_unicode()
    tokens = [chars[b] for b in range(BYTE_TOKENS)]
    merge = f"{chars[0]} {chars[1]}"  # NUL then SOH: never in a prompt
    tokens += [chars[0] + chars[1], "<|bos|>", "<|eos|>"]
    return tokens, merge


def _weights(spec: TinyLlamaSpec) -> dict[str, np.ndarray]:
    """Random weights, numpy shape (out, in) per linear layer as the GGUF converters write."""
    rng = np.random.default_rng(spec.seed)
    d, ff, kv = spec.n_embd, spec.n_ff, spec.head_dim * spec.n_head_kv

    def dense(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    embd = (rng.standard_normal((VOCAB_SIZE, d)) * 0.5).astype(np.float32)
    embd[:, STEER_DIM] = STEER_VALUE
    head = dense(VOCAB_SIZE, d)
    printable = np.zeros(VOCAB_SIZE, dtype=bool)
    printable[0x20:0x7F] = True
    head[:, STEER_DIM] = np.where(printable, STEER_LOGIT, -STEER_LOGIT)
    out: dict[str, np.ndarray] = {
        "token_embd.weight": embd,
        "output_norm.weight": np.ones(d, dtype=np.float32),
        "output.weight": head,
    }
    for i in range(spec.n_layer):
        attn_out = dense(d, d)
        ffn_down = dense(d, ff)
        attn_out[STEER_DIM, :] = 0.0  # the layers never write the steering dimension
        ffn_down[STEER_DIM, :] = 0.0
        out |= {
            f"blk.{i}.attn_norm.weight": np.ones(d, dtype=np.float32),
            f"blk.{i}.attn_q.weight": dense(d, d),
            f"blk.{i}.attn_k.weight": dense(kv, d),
            f"blk.{i}.attn_v.weight": dense(kv, d),
            f"blk.{i}.attn_output.weight": attn_out,
            f"blk.{i}.ffn_norm.weight": np.ones(d, dtype=np.float32),
            f"blk.{i}.ffn_gate.weight": dense(ff, d),
            f"blk.{i}.ffn_up.weight": dense(ff, d),
            f"blk.{i}.ffn_down.weight": ffn_down,
        }
    return out


def write_gguf(path: str | Path, spec: TinyLlamaSpec = TinyLlamaSpec()) -> Path:
    """Write the model to ``path`` (atomically: a temporary file, then a rename)."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), ARCH)
    writer.add_name(spec.stem())
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_eps)
    writer.add_vocab_size(VOCAB_SIZE)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens, merge = _vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    types = [gguf.TokenType.NORMAL] * (BYTE_TOKENS + 1) + [gguf.TokenType.CONTROL] * 2
    writer.add_token_types(types)
    writer.add_token_merges([merge])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    for name, array in _weights(spec).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path


def write_tokenizer_json(path: str | Path) -> Path:
    """A Hugging Face ``tokenizer.json`` with the model's byte-level vocabulary and merge:
    what the router loads (``tokenizer`` in the engines file) to count tokens as llama.cpp."""
    tokens, merge = _vocab()
    vocab = {tok: i for i, tok in enumerate(tokens[: MERGE_ID + 1])}
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": tokens[i],
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i in (BOS_ID, EOS_ID)
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": vocab,
            "merges": [merge],
        },
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, ensure_ascii=False))
    return path


def ensure_model(directory: str | Path, spec: TinyLlamaSpec = TinyLlamaSpec()) -> tuple[Path, Path]:
    """(GGUF path, tokenizer.json path) in ``directory``, written once per shape."""
    directory = Path(directory).expanduser()
    gguf_path = directory / f"{spec.stem()}.gguf"
    tok_path = directory / f"{spec.stem()}.tokenizer.json"
    if not gguf_path.exists():
        write_gguf(gguf_path, spec)
    if not tok_path.exists():
        write_tokenizer_json(tok_path)
    return gguf_path, tok_path
