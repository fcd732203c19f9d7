"""What clients send as max_tokens, applied to a trace (``bench predict --max-tokens``)."""

from __future__ import annotations

import pytest

from foretoken.core.types import RequestId
from foretoken.sim.clients import LOOSE_RANGE, MIX_CAPS, MaxTokensModel
from foretoken.sim.traces import TraceRequest


def requests(n: int = 400) -> list[TraceRequest]:
    return [TraceRequest(request_id=RequestId(f"q{i}"), arrival_s=float(i), prompt_tokens=10,
                         output_tokens=1 + (i * 37) % 3000, segment_keys=(i,),
                         segment_lengths=(10,)) for i in range(n)]  # fmt: skip


def test_exact_is_the_trace_as_recorded() -> None:
    rows = requests()
    assert MaxTokensModel.parse("exact").apply(rows) == rows
    assert all(r.sent_max_tokens == r.output_tokens for r in rows)


def test_a_fixed_cap_truncates_longer_answers() -> None:
    rows = MaxTokensModel.parse("cap:1024").apply(requests())
    assert all(r.sent_max_tokens == 1024 and r.output_tokens <= 1024 for r in rows)
    assert any(r.output_tokens == 1024 for r in rows) and any(r.output_tokens < 1024 for r in rows)


def test_none_sends_nothing_and_keeps_the_answer() -> None:
    before = requests()
    rows = MaxTokensModel.parse("NONE").apply(before)
    assert all(r.sent_max_tokens is None for r in rows)
    assert [r.output_tokens for r in rows] == [r.output_tokens for r in before]


def test_loose_budgets_are_above_the_answer_and_seeded() -> None:
    model = MaxTokensModel.parse("loose")
    rows = model.apply(requests(), seed=3)
    for r in rows:
        assert r.sent_max_tokens is not None and r.sent_max_tokens % 64 == 0
        assert r.output_tokens <= r.sent_max_tokens <= LOOSE_RANGE[1] * r.output_tokens + 64
    assert rows == model.apply(requests(), seed=3)
    assert rows != model.apply(requests(), seed=4)


def test_mix_has_every_kind_of_client() -> None:
    rows = MaxTokensModel.parse("mix").apply(requests(), seed=1)
    sent = [r.sent_max_tokens for r in rows]
    assert 0.15 < sum(s is None for s in sent) / len(sent) < 0.35
    assert 0.4 < sum(s in MIX_CAPS for s in sent) / len(sent) < 0.6
    assert all(s is None or r.output_tokens <= s for r, s in zip(rows, sent, strict=True))


@pytest.mark.parametrize("text", ["cap", "cap:0", "cap:x", "exactly", "none:3", ""])
def test_a_bad_model_is_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match="max-tokens"):
        MaxTokensModel.parse(text)
