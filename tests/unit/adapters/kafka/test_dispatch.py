from __future__ import annotations

from foretoken.adapters.kafka.dispatch import Dispatcher, Position, reason_kind
from foretoken.wire.codec import decode, encode
from foretoken.wire.records import Grant, Record


def _grant(i: int) -> bytes:
    return encode(Grant(request_id=f"r{i}", ts=1.0, model="m", prompt_tokens=i, admitted=False))


def test_valid_records_reach_handlers_and_are_counted() -> None:
    seen: list[tuple[Record, Position]] = []
    d = Dispatcher()
    d.on("grants", lambda record, pos: seen.append((record, pos)))
    for i in range(3):
        out = d.consume("grants", "grants", b"k", _grant(i), 0, 10 + i)
        assert out.dead_letter is None
    assert [getattr(g, "request_id", None) for g, _ in seen] == ["r0", "r1", "r2"]
    assert [pos.offset for _, pos in seen] == [10, 11, 12]
    assert d.counts["grants"] == 3


def test_malformed_input_is_dead_lettered_with_reason_and_the_rest_goes_on() -> None:
    d = Dispatcher()
    bad = d.consume("grants", "pfx-grants", b"k", b"\x00garbage", 2, 17)
    assert bad.record is None and bad.dead_letter is not None
    assert bad.dead_letter.source == "pfx-grants"
    assert (bad.dead_letter.partition, bad.dead_letter.offset) == (2, 17)
    assert bad.dead_letter.payload == b"\x00garbage"
    assert "first byte" in bad.dead_letter.reason
    good = d.consume("grants", "pfx-grants", b"k", _grant(1))
    assert good.dead_letter is None
    assert d.dead["pfx-grants"] == 1 and d.counts["grants"] == 1


def test_a_raising_handler_dead_letters_but_does_not_stop_the_dispatcher() -> None:
    d = Dispatcher()

    def explode(record: Record, pos: Position) -> None:
        raise RuntimeError("boom")

    d.on("grants", explode)
    out = d.consume("grants", "grants", None, _grant(1))
    assert out.dead_letter is not None and "RuntimeError: boom" in out.dead_letter.reason
    dl = decode(encode(out.dead_letter), type(out.dead_letter))
    assert dl == out.dead_letter


def test_reason_kind_is_low_cardinality() -> None:
    assert reason_kind("invalid Grant: Expected `str`, got `int` - at `$.x`") == "invalid Grant"


def test_a_tombstone_means_what_its_topic_says_and_an_unknown_one_is_counted() -> None:
    d = Dispatcher()
    seen: list[Record] = []
    d.on("grants", lambda record, pos: seen.append(record))
    known = Grant(request_id="r9", ts=1.0, model="m", prompt_tokens=9, admitted=False)
    d.on_tombstone("grants", lambda key: known if key == b"r9" else None)
    assert d.consume("grants", "grants", b"r9", None).dead_letter is None
    assert d.consume("grants", "grants", b"zz", None).dead_letter is None
    assert seen == [known] and d.counts["grants_tombstone_unknown"] == 1
    # on a topic without a meaning for it, a null value is still a dead letter
    assert d.consume("outcomes", "outcomes", b"r9", None).dead_letter is not None
