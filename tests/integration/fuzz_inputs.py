"""What the fuzz suite throws at ingest and the route service (pure generators).

Hypothesis draws the plan of each batch of inputs — which kinds, how many, their seeds and
sizes — and a seeded ``random.Random`` builds the bytes from it, so that one hypothesis
example yields a few hundred inputs at the cost of a few draws (the suite's ≥ 10⁵ inputs
then take seconds to generate, not minutes)."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any, Final

import msgspec
from hypothesis import strategies as st

from foretoken.sim.live.vllm_wire import encode_vllm_payload, seq_bytes
from foretoken.wire.records import AllCleared, BlockRemoved, BlockStored, KvEvent
from foretoken.wire.route_rpc import pack_token_ids

BLOCK: Final = 16
FRAME_KINDS: Final = ("valid", "mutated", "truncated", "random", "deep", "shape", "typed")
BODY_KINDS: Final = ("valid", "fields", "mutated", "truncated", "random", "deep", "numbers",
                     "msgpack", "strings")  # fmt: skip
ROUTE_FIELDS: Final = ("request_id", "model", "token_ids", "packed_token_ids", "prompt_tokens",
                       "max_queue_wait_s", "already_waited_s", "workload_class",
                       "prefer_cache_hit", "conversation_id", "expected_output_tokens",
                       "schema_version")  # fmt: skip

PER_EXAMPLE: Final = 450  # frames, and as many bodies, per hypothesis example


@dataclass(frozen=True)
class Plan:
    """One example's plan: which kinds appear (each at least once, the rest in proportion to
    their weights) and the seed of the generator that builds them. A few draws an example, so
    that hypothesis costs nothing next to the inputs themselves."""

    seed: int
    weights: tuple[int, ...]

    def items(self, kinds: tuple[str, ...], n: int = PER_EXAMPLE) -> list[tuple[str, int]]:
        rnd = random.Random(self.seed)
        present = [k for k, w in zip(kinds, self.weights, strict=True) if w]
        weights = [w for w in self.weights if w]
        picked = present + rnd.choices(present, weights, k=n - len(present))
        return [(kind, rnd.randrange(2**32)) for kind in picked]


def plans(kinds: tuple[str, ...]) -> st.SearchStrategy[Plan]:
    weights = st.lists(st.integers(0, 4), min_size=len(kinds), max_size=len(kinds)).filter(any)
    return st.builds(Plan, st.integers(0, 2**32), weights.map(tuple))


frame_plans = plans(FRAME_KINDS)
body_plans = plans(BODY_KINDS)


# --------------------------------------------------------------------------- values


def any_value(rnd: random.Random, depth: int = 0) -> Any:
    """A random msgpack/JSON-able value: every type the decoders might meet."""
    pick = rnd.randrange(12 if depth < 4 else 8)
    if pick == 0:
        return None
    if pick == 1:
        return rnd.random() < 0.5
    if pick == 2:
        return rnd.randint(-(2**63), 2**64 - 1)
    if pick == 3:
        return rnd.choice([0, -1, 1, 2**32, 2**32 - 1, 2**63, 2**64 - 1, -(2**63)])
    if pick == 4:
        return rnd.choice([0.0, -0.0, 1e300, -1e-300, float("inf"), float("nan"), 3.5])
    if pick == 5:
        return "".join(chr(rnd.randrange(0x20, 0x2FF)) for _ in range(rnd.randrange(12)))
    if pick == 6:
        return rnd.choice(["GPU", "CPU", "DISK", "BlockStored", "BlockRemoved", "", "type"])
    if pick == 7:
        return rnd.randbytes(rnd.randrange(40))
    if pick in (8, 9):
        return [any_value(rnd, depth + 1) for _ in range(rnd.randrange(5))]
    return {str(any_value(rnd, 3)): any_value(rnd, depth + 1) for _ in range(rnd.randrange(4))}


def _json_safe(value: Any) -> Any:
    """``value`` without what JSON cannot carry (bytes, non-finite floats, huge ints)."""
    if isinstance(value, bytes):
        return value.decode("latin-1")
    if isinstance(value, float) and not math.isfinite(value):
        return 1e308
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


def mutate(rnd: random.Random, node: Any, rate: float = 0.25) -> Any:
    """A copy of ``node`` with random subtrees replaced, dropped or added."""
    if rnd.random() < rate / 4:
        return any_value(rnd, 2)
    if isinstance(node, list):
        out = [mutate(rnd, v, rate) for v in node if rnd.random() > rate / 4]
        if rnd.random() < rate / 4:
            out.insert(rnd.randrange(len(out) + 1), any_value(rnd, 2))
        return out
    if isinstance(node, dict):
        kept = {k: mutate(rnd, v, rate) for k, v in node.items() if rnd.random() > rate / 4}
        if rnd.random() < rate / 4:
            kept[str(any_value(rnd, 3))] = any_value(rnd, 2)
        return kept
    return node


# --------------------------------------------------------------------------- frames


def events(rnd: random.Random, first_hash: int, blocks: int | None = None) -> list[KvEvent]:
    out: list[KvEvent] = []
    for _ in range(rnd.randrange(1, 5)):
        n = blocks if blocks is not None else rnd.randrange(1, 8)
        kind = rnd.random()
        if kind < 0.6:
            start = rnd.randrange(1, 30_000)
            out.append(BlockStored(
                block_hashes=tuple(first_hash + i for i in range(n)),
                token_ids=tuple(start + i for i in range(n * BLOCK)), block_size=BLOCK,
                medium=rnd.choice(["GPU", "GPU", "CPU"]),
            ))  # fmt: skip
        elif kind < 0.9:
            out.append(BlockRemoved(block_hashes=tuple(first_hash + i for i in range(n))))
        else:
            out.append(AllCleared())
        first_hash += n
    return out


def valid_payload(rnd: random.Random, blocks: int | None = None) -> bytes:
    encoding = rnd.choice(["map", "array"])
    batch = events(rnd, rnd.randrange(2**40), blocks)
    return encode_vllm_payload(time.time(), batch, block_size=BLOCK, encoding=encoding)


class FrameMaker:
    """Builds one engine's messages from a plan; valid ones carry the next seq, so the
    stream mixes in-order batches, gaps (a mutated frame that happens to decode), garbage
    and restarts (a random seq that goes back)."""

    def __init__(self) -> None:
        self.seq = 0

    def frames(self, kind: str, seed: int) -> list[bytes]:
        rnd = random.Random(seed)
        seq = self.seq if rnd.random() < 0.9 else rnd.randrange(2**64)
        if kind == "valid":
            self.seq += 1
            return [b"", seq_bytes(seq), valid_payload(rnd)]
        if kind == "mutated":
            tree = msgspec.msgpack.decode(valid_payload(rnd))
            return [b"", seq_bytes(seq), msgspec.msgpack.encode(mutate(rnd, tree))]
        if kind == "truncated":
            payload = valid_payload(rnd)
            return [b"", seq_bytes(seq), payload[: rnd.randrange(len(payload))]]
        if kind == "random":
            return [rnd.randbytes(rnd.randrange(64)) for _ in range(rnd.randrange(1, 5))]
        if kind == "deep":
            depth = 100_000 if rnd.random() < 0.02 else rnd.choice([100, 900, 1_100, 2_000])
            opener = rnd.choice([b"\x91", b"\x81\xa1k", b"\x92\xc0"])
            return [b"", seq_bytes(seq), opener * depth + b"\xc0"]
        if kind == "shape":
            return rnd.choice([
                [b"", seq_bytes(seq)], [b"", b"\x01\x02\x03", valid_payload(rnd)],
                [b"", seq_bytes(seq), valid_payload(rnd), b"extra"], [b"only"],
                [b"", seq_bytes(seq), b""],
            ])  # fmt: skip
        # typed: a batch whose fields have the wrong types (a map or an array form)
        batch = rnd.choice([
            [any_value(rnd), [any_value(rnd) for _ in range(3)], any_value(rnd)],
            {"ts": any_value(rnd), "events": any_value(rnd), "data_parallel_rank": any_value(rnd)},
            [time.time(), [["BlockStored", *(any_value(rnd) for _ in range(rnd.randrange(11)))]]],
            [time.time(), [{"type": "BlockRemoved", "block_hashes": any_value(rnd)}]],
        ])  # fmt: skip
        return [b"", seq_bytes(seq), msgspec.msgpack.encode(batch)]


# --------------------------------------------------------------------------- bodies


def valid_route(rnd: random.Random, rid: str, model: str) -> dict[str, Any]:
    n = rnd.randrange(1, 600)
    body: dict[str, Any] = {"request_id": rid, "model": model}
    if rnd.random() < 0.5:
        body["token_ids"] = [rnd.randrange(50_000) for _ in range(n)]
    else:
        body["prompt_tokens"] = n
    if rnd.random() < 0.5:
        body["max_queue_wait_s"] = rnd.choice([5.0, 30.0, 300.0])
    return body


def body(kind: str, seed: int, model: str) -> tuple[bytes, str]:
    """One route body of ``kind`` and its content type."""
    rnd = random.Random(seed)
    rid = f"fz{seed}"
    if kind == "valid":
        return msgspec.json.encode(valid_route(rnd, rid, model)), "application/json"
    if kind == "fields":
        some = {f: _json_safe(any_value(rnd)) for f in rnd.sample(ROUTE_FIELDS, rnd.randrange(6))}
        return msgspec.json.encode(some), "application/json"
    if kind == "mutated":
        tree = mutate(rnd, valid_route(rnd, rid, model), 0.5)
        return msgspec.json.encode(_json_safe(tree)), "application/json"
    if kind == "truncated":
        raw = msgspec.json.encode(valid_route(rnd, rid, model))
        return raw[: rnd.randrange(len(raw))], "application/json"
    if kind == "random":
        return rnd.choice([b"{", b"\x80", b"\xde"]) + rnd.randbytes(rnd.randrange(80)), "x/y"
    if kind == "deep":
        depth = 100_000 if rnd.random() < 0.02 else rnd.choice([500, 1_100, 2_000])
        inner = (
            (b"[" * depth + b"]" * depth)
            if rnd.random() < 0.5
            else (b'{"a":' * depth + b"1" + b"}" * depth)
        )
        return b'{"request_id": "d", "model": "m", "x": ' + inner + b"}", "application/json"
    if kind == "numbers":
        field = rnd.choice(["prompt_tokens", "expected_output_tokens", "max_queue_wait_s",
                            "already_waited_s", "token_ids", "schema_version"])  # fmt: skip
        number = rnd.choice([b"1e400", b"-1e400", b"1" + b"0" * 30, b"-1", b"18446744073709551616",
                             b"4294967296", b"-0", b"1.5", b"NaN", b"0"])  # fmt: skip
        value = b"[" + number + b"]" if field == "token_ids" else number
        return (b'{"request_id": "n", "model": "' + model.encode() + b'", "prompt_tokens": 3, "'
                + field.encode() + b'": ' + value + b"}"), "application/json"  # fmt: skip
    if kind == "msgpack":
        fields: dict[str, Any] = valid_route(rnd, rid, model)
        if rnd.random() < 0.5:
            fields.pop("token_ids", None)
            ids = [rnd.randrange(2**32) for _ in range(rnd.randrange(200))]
            packed = pack_token_ids(ids)
            fields["packed_token_ids"] = packed[: rnd.randrange(len(packed) + 1)]
        return msgspec.msgpack.encode(mutate(rnd, fields, 0.3)), "application/msgpack"
    # strings: invalid UTF-8, lone surrogates, control characters, very long ids
    text = rnd.choice([b"\xed\xa0\x80", b"\\ud800", b"\xff\xfe", b"\x00", b"\\u0000",
                       b"x" * 5_000])  # fmt: skip
    where = rnd.choice([b"request_id", b"model", b"workload_class", b"conversation_id"])
    return (b'{"request_id": "s", "model": "m", "prompt_tokens": 1, "' + where + b'": "' + text
            + b'"}'), "application/json"  # fmt: skip
