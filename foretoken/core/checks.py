"""Bounds on what a value may say, and the checks the core's values run on construction
and on decode (:mod:`foretoken.core.types`). Pure."""

from __future__ import annotations

import math
from typing import Final

U64_MASK: Final = (1 << 64) - 1


def check_u64(name: str, values: tuple[int, ...]) -> None:
    if values and (min(values) < 0 or max(values) > U64_MASK):
        raise ValueError(f"{name} must be unsigned 64-bit (normalize engine hashes first)")


# Bounds on what a record may say (beyond them a record is a mistake or an attack, and one
# such value poisons every prediction of its worker: a 2^40 block size, a year-3000
# timestamp, a 10^12-token grant — docs/ARCHITECTURE.md, "Values and records").
MAX_BLOCK_SIZE: Final = 1 << 16
MAX_PROMPT_TOKENS: Final = 1 << 24
MAX_TS: Final = 4_102_444_800.0  # 2100-01-01: a time past it is not a clock's
MAX_DURATION_S: Final = 86_400.0 * 7
MAX_GROUP_IDX: Final = (1 << 16) - 1  # KV cache groups (vLLM: a handful per model)
MAX_DP_RANK: Final = (1 << 16) - 1  # data-parallel ranks of one engine


def check_group(group_idx: int) -> None:
    if not 0 <= group_idx <= MAX_GROUP_IDX:
        raise ValueError(f"group_idx must be within 0..{MAX_GROUP_IDX}, got {group_idx}")


def check_ts(name: str, value: float) -> None:
    check_finite(name, value)
    if value > MAX_TS:
        raise ValueError(f"{name} must be a unix time before 2100, got {value}")


MAX_ID_CHARS: Final = 1024  # request, worker and model ids, classes, conversations
MAX_ERROR_CHARS: Final = 8192
MAX_COUNT: Final = 1 << 40  # token counts of one request or queue: far past any engine's
MAX_OUTPUT_TOKENS: Final = (1 << 31) - 1
MAX_SEQS: Final = 1 << 20  # sequences an engine runs at once
MAX_LORA_ADAPTERS: Final = 4096  # adapters one engine serves


# A prediction's parts: a queue of a million requests is a long wait, not an overflow.
MAX_PREDICTED_S: Final = 1e8
PART_SLACK_S: Final = 1.0  # a part a rounding below 0 is still a part


def check_part(name: str, value: float | None) -> None:
    """A prediction's part (queue wait, own prefill): finite, about >= 0, not astronomic."""
    check_finite(name, value, minimum=-PART_SLACK_S)
    if value is not None and value > MAX_PREDICTED_S:
        raise ValueError(f"{name} must be at most {MAX_PREDICTED_S:g} s, got {value}")


def check_len(name: str, value: str | None, limit: int = MAX_ID_CHARS) -> None:
    if value is not None and len(value) > limit:
        raise ValueError(f"{name} must be at most {limit} characters, got {len(value)}")


def check_count(name: str, value: int | None, limit: int = MAX_COUNT) -> None:
    if value is not None and not 0 <= value <= limit:
        raise ValueError(f"{name} must be within 0..{limit}, got {value}")


def check_finite(name: str, value: float | None, *, minimum: float | None = 0.0) -> None:
    """A value that must be finite (and at least ``minimum``) when given."""
    if value is None:
        return
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_settings_numbers(config: object, signed: tuple[str, ...] = ()) -> None:
    """Every number field of a dataclass or msgspec Struct of settings is finite and, unless
    named in ``signed``, >= 0 (a typo'd minus sign used to be taken: a negative window or
    iteration count made the fits or controls silently do nothing)."""
    names = getattr(config, "__struct_fields__", None) or getattr(
        config, "__dataclass_fields__", {}
    )
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")
        if value < 0 and name not in signed:
            raise ValueError(f"{name} must be >= 0, got {value}")
