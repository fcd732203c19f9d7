"""Encoding and decoding of wire records: msgspec JSON or msgpack, never pickle, told apart
by the first byte; anything that is not a valid record raises :class:`DecodeError` with the
reason the consumers put on ``dead-letter``."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from foretoken.core.checks import U64_MASK
from foretoken.core.types import EngineBlockHash
from foretoken.wire.records import WireFormat

T = TypeVar("T")


class DecodeError(ValueError):
    """Input that is not a valid record; ``reason`` is what goes to the dead-letter topic."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()
_json_decoders: dict[type[Any], msgspec.json.Decoder[Any]] = {}
_msgpack_decoders: dict[type[Any], msgspec.msgpack.Decoder[Any]] = {}
_JSON_FIRST = frozenset((0x7B, 0x20, 0x0A, 0x0D, 0x09))  # '{' or leading whitespace


def encode(record: msgspec.Struct, wire_format: WireFormat = "json") -> bytes:
    if wire_format == "msgpack":
        return _msgpack_encoder.encode(record)
    return _json_encoder.encode(record)


def decode(data: bytes | None, record_type: type[T]) -> T:
    """Decode JSON or msgpack (told apart by the first byte) into a validated record."""
    if not data:
        raise DecodeError("empty payload")
    first = data[0]
    name = getattr(record_type, "__name__", str(record_type))
    try:
        if first in _JSON_FIRST:
            dec = _json_decoders.get(record_type)
            if dec is None:
                dec = _json_decoders[record_type] = msgspec.json.Decoder(record_type)
            result: T = dec.decode(data)
            return result
        if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):  # a msgpack map
            mdec = _msgpack_decoders.get(record_type)
            if mdec is None:
                mdec = _msgpack_decoders[record_type] = msgspec.msgpack.Decoder(record_type)
            mresult: T = mdec.decode(data)
            return mresult
    except msgspec.ValidationError as exc:
        raise DecodeError(f"invalid {name}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise DecodeError(f"malformed {name} payload: {exc}") from exc
    except RecursionError as exc:  # nesting deeper than the decoder follows
        raise DecodeError(f"malformed {name} payload: nested too deeply") from exc
    except ValueError as exc:  # raised from __post_init__ checks
        raise DecodeError(f"invalid {name}: {exc}") from exc
    raise DecodeError(f"not a JSON object or msgpack map (first byte 0x{first:02x})")


def normalize_engine_hash(value: int | bytes | bytearray) -> EngineBlockHash:
    """Engine block hashes to unsigned 64-bit: vLLM uint64 as is, SGLang's signed int64 as
    two's complement, raw digests (vLLM's 32 bytes) by their low 8 bytes, which is how vLLM
    derives its integer form."""
    if isinstance(value, bool):
        raise DecodeError("a block hash cannot be a bool")
    if isinstance(value, int):
        if value < -(1 << 63) or value > U64_MASK:
            raise DecodeError(f"block hash {value} is outside 64 bits")
        return EngineBlockHash(value & U64_MASK)
    if isinstance(value, bytes | bytearray):
        if not value:
            raise DecodeError("empty block hash")
        return EngineBlockHash(int.from_bytes(bytes(value[-8:]), "big"))
    raise DecodeError(f"a block hash must be an int or bytes, got {type(value).__name__}")
