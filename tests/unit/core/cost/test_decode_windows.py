"""Decode samples without the prefill of others (foretoken.core.cost.decode_windows)."""

from __future__ import annotations

import pytest

from foretoken.core.cost.decode_windows import DecodeWindows
from foretoken.core.types import RequestId, WorkerId

W = WorkerId("w")


def test_a_window_subtracts_the_prompts_prefilled_during_it_and_averages_the_decoders() -> None:
    windows = DecodeWindows(min_share=0.1)
    windows.open(W, RequestId("r"), 0.0, 500, 0)  # r decodes from t = 0
    windows.open(W, RequestId("o"), 1.0, 1000, 200)  # o's prompt done at t = 1, 800 new
    window = windows.close(RequestId("r"), 2.0, span_s=2.0, output_tokens=11)
    assert window is not None
    assert (window.u, window.v) == (800, 1000**2 - 200**2)  # o's, not r's own prompt
    sample = window.sample(a=1e-3, b=0.0, min_share=0.1)
    assert sample is not None
    tpot, mean_decoding = sample
    assert tpot == pytest.approx((2.0 - 0.8) / 10)  # less o's 0.8 s of prefill
    assert mean_decoding == pytest.approx((1.0 * 2.0 + 1.0 * 1.0) / 2.0)  # r 2 s, o 1 s


def test_a_window_that_was_almost_all_prefill_is_no_sample() -> None:
    windows = DecodeWindows(min_share=0.1)
    windows.open(W, RequestId("r"), 0.0, 100, 0)
    windows.open(W, RequestId("o"), 1.0, 1950, 0)
    window = windows.close(RequestId("r"), 2.0, span_s=2.0, output_tokens=11)
    assert window is not None
    assert window.sample(a=1e-3, b=0.0, min_share=0.1) is None  # 1.95 of 2 s: prefill
    assert window.sample(a=1e-4, b=0.0, min_share=0.1) is not None


def test_no_window_without_a_first_token_or_a_decode() -> None:
    windows = DecodeWindows()
    assert windows.close(RequestId("never"), 1.0, span_s=1.0, output_tokens=5) is None
    windows.open(W, RequestId("one"), 0.0, 100, 0)
    assert windows.close(RequestId("one"), 1.0, span_s=1.0, output_tokens=1) is None
