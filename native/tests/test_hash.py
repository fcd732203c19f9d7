"""The native content hash (spec v2) against PyPI's xxhash: the Python reference computes the
same spec with ``xxhash.xxh3_64_intdigest``, so both must give bit-identical values."""

from __future__ import annotations

import array

import foretoken_native as fn
import hypothesis.strategies as st
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings

SEP = b"\x1f"


def ref_root_seed(salt: bytes, model: str, block_size: int, lora_name: str | None) -> int:
    lora = b"\x00" if lora_name is None else b"\x01" + lora_name.encode()
    data = SEP.join([b"foretoken-root-v2", salt, model.encode(), str(block_size).encode(), lora])
    return xxhash.xxh3_64_intdigest(data)


def ref_extra_key_mix(key: str) -> int:
    return xxhash.xxh3_64_intdigest(b"extra" + SEP + key.encode()) if key else 0


def ref_chain(seed: int, tokens: list[int], block_size: int, extra_keys: list[str]) -> list[int]:
    out, h = [], seed
    for i in range(len(tokens) // block_size):
        data = array.array("I", tokens[i * block_size : (i + 1) * block_size]).tobytes()
        if i < len(extra_keys) and extra_keys[i]:
            data += ref_extra_key_mix(extra_keys[i]).to_bytes(8, "little")
        h = xxhash.xxh3_64_intdigest(data, seed=h)
        out.append(h)
    return out


token_ids = st.lists(st.integers(0, 2**32 - 1), max_size=300)


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1),
    tokens=token_ids,
    block_size=st.integers(1, 70),
    keys=st.lists(st.sampled_from(["", "", "img:1", "ü-salt", "x" * 300]), max_size=12),
)
def test_chain_equals_xxhash_for_random_inputs(
    seed: int, tokens: list[int], block_size: int, keys: list[str]
) -> None:
    expected = ref_chain(seed, tokens, block_size, keys)
    packed = array.array("I", tokens).tobytes()
    got = fn.chain(seed, packed, block_size, keys)
    assert got.dtype == np.uint64
    assert got.tolist() == expected
    as_bytes = fn.chain_bytes(seed, packed, block_size, keys)
    assert np.frombuffer(as_bytes, "<u8").tolist() == expected


@settings(max_examples=200, deadline=None)
@given(
    salt=st.binary(max_size=20),
    model=st.text(max_size=20),
    block_size=st.integers(-5, 10**6),
    lora=st.none() | st.text(max_size=20),
    key=st.text(max_size=30),
)
def test_root_seed_and_extra_key_mix_equal_xxhash(
    salt: bytes, model: str, block_size: int, lora: str | None, key: str
) -> None:
    assert fn.root_seed(salt, model, block_size, lora) == ref_root_seed(
        salt, model, block_size, lora
    )
    assert fn.extra_key_mix(key) == ref_extra_key_mix(key)


def test_every_token_input_form_hashes_alike() -> None:
    ids = list(range(70_000, 70_000 + 96))
    expected = ref_chain(3, ids, 16, [])
    forms = [
        array.array("I", ids).tobytes(),
        bytearray(array.array("I", ids).tobytes()),
        memoryview(array.array("I", ids).tobytes()),
        array.array("I", ids),
        np.array(ids, dtype=np.uint32),
        np.array(ids, dtype=np.int64),
        np.array(ids, dtype=np.int32),
        np.array(ids, dtype=np.uint64),
        np.array(ids, dtype=np.int64)[::1],
        np.array(ids * 2, dtype=np.int64)[::2][: len(ids)] * 0 + np.array(ids),  # a copy
        np.array([ids, ids], dtype=np.uint32)[:, 0:96][0],
        np.repeat(np.array(ids, dtype=np.uint32), 2)[::2],  # strided, not contiguous
        ids,
        tuple(ids),
        iter(ids),
    ]
    for form in forms:
        assert fn.chain(3, form, 16).tolist() == expected, type(form)


def test_bad_token_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        fn.chain(0, b"\x00" * 6, 1)
    with pytest.raises(ValueError, match="outside"):
        fn.chain(0, [1, -1], 1)
    with pytest.raises(ValueError, match="outside"):
        fn.chain(0, np.array([2**32], dtype=np.int64), 1)
    with pytest.raises(TypeError):
        fn.chain(0, 12, 1)
    with pytest.raises(ValueError, match="block_size"):
        fn.chain(0, b"", 0)


def test_max_blocks_and_partial_blocks() -> None:
    ids = list(range(50))
    assert fn.chain(9, ids, 16).tolist() == ref_chain(9, ids, 16, [])  # 3 full blocks
    assert fn.chain(9, ids, 16, max_blocks=2).tolist() == ref_chain(9, ids, 16, [])[:2]
    assert fn.chain(9, [], 16).tolist() == []
