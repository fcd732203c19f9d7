"""Which observations are samples for the fits of :mod:`foretoken.core.cost.fit`: cold
prefill samples (a request that ran alone with known reuse) and decode samples (time per
output token, and a decode step's time from a stream's token gaps)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Final

import msgspec

from foretoken.core.cost.fit import (
    MIN_COLD_PROMPT_TOKENS,
    MIN_DECODE_OUTPUT_TOKENS,
    _positive_finite,
)
from foretoken.core.types import CacheSource, GradedRequest

# Unknown reuse on an approximate cache view: a request whose credited (approximately cached)
# part is at most 1/NEAR_COLD_SHARE of its prompt is a prefill sample with the credit as its
# cached part. Whatever the engine really reused of that part, C(credited) is at most about
# 1/NEAR_COLD_SHARE of C(prompt), so the sample is off by no more than that.
NEAR_COLD_SHARE: Final = 16


def time_per_output_token_s(
    e2e_s: float | None,
    ttft_s: float | None,
    output_tokens: int | None,
    min_output_tokens: int = MIN_DECODE_OUTPUT_TOKENS,
) -> float | None:
    """``(e2e − ttft) / (output_tokens − 1)``, or None when that is not a usable TPOT."""
    if e2e_s is None or ttft_s is None or output_tokens is None:
        return None
    if output_tokens < max(min_output_tokens, 2) or not _positive_finite(e2e_s - ttft_s):
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


# The fast gaps of a stream: at most FAST_GAP_SPREAD × its FAST_GAP_QUANTILE quantile.
FAST_GAP_QUANTILE: Final = 0.1
FAST_GAP_SPREAD: Final = 1.5
MIN_TOKEN_GAPS: Final = 2


def decode_step_s(gaps_s: Sequence[float]) -> float | None:
    """A decode step's time from one stream's gaps between output tokens: the median of its
    fast gaps (at most 1.5× the 10th percentile). With chunked prefill an engine's steps
    are of two kinds, those that also carry a chunk of another prompt and those that only
    decode; the fast gaps are the second kind whenever there are some, so the figure is a
    step without prefill even where most steps carry one. None with fewer than 2 gaps."""
    n = len(gaps_s)
    if n < MIN_TOKEN_GAPS:
        return None
    ordered = sorted(gaps_s)
    limit = FAST_GAP_SPREAD * ordered[int(FAST_GAP_QUANTILE * (n - 1))]
    fast = bisect.bisect_right(ordered, limit)
    value = ordered[(fast - 1) // 2]
    return value if _positive_finite(value) else None


def select_cold_sample(
    graded: GradedRequest,
    *,
    others_running: bool,
    min_prompt_tokens: int = MIN_COLD_PROMPT_TOKENS,
    trust_index_when_engine_silent: bool = False,
    in_event_time: bool = False,
) -> bool:
    """Whether a graded request is a cold prefill sample (its TTFT ≈ C(prompt_tokens)).

    True iff it was served (admitted, on a worker, a finite TTFT > 0); nothing was cached;
    nothing else ran on that worker between grant and first token (``others_running``,
    from the caller's queue model) and the predictor saw no queue ahead
    (``queue_tokens_ahead == 0``, unless ``in_event_time``: the caller judged
    ``others_running`` by when every request there was sent and started, which the queue
    the predictor saw at the decision may not have known yet); and the prompt has at least
    ``min_prompt_tokens`` tokens (below that, fixed latency dominates). Explore and
    fallback grants are accepted: they change which worker served, not what was measured.

    "Nothing was cached" is what can be known about the worker:

    * the engine reports cached tokens: it reported a known 0 (None means it did not say,
      and a hit we cannot see would make the sample look fast);
    * the engine never reports them but publishes KV events: only with
      ``trust_index_when_engine_silent``, when the index credited nothing and its view
      was exact (vLLM omits the field on a miss);
    * the engine reports nothing at all (``cache_source == "approximate"``: no KV events,
      unknown reuse): a first request for a never-seen prefix — the approximate index
      credited nothing, i.e. no block of this prompt's prefix was routed to that worker by
      us within the TTL and capacity of :mod:`foretoken.core.index.approx` — on an idle worker.
    """
    if graded.status != "served" or not graded.admitted or graded.worker_id is None:
        return False
    ttft = graded.actual_ttft_s
    if ttft is None or not _positive_finite(ttft) or graded.prompt_tokens < min_prompt_tokens:
        return False
    if others_running or (graded.queue_tokens_ahead > 0 and not in_event_time):
        return False
    if graded.engine_cached_tokens is None:
        if graded.credited_cached_tokens != 0:
            return False
        if graded.cache_source == CacheSource.APPROXIMATE:
            return True
        return trust_index_when_engine_silent and not graded.approximate_cache
    return graded.engine_cached_tokens == 0


def prefill_sample_cached(
    graded: GradedRequest, *, others_running: bool, in_event_time: bool = False
) -> int | None:
    """The engine-reported cached tokens if this graded request is a prefill sample, else
    None. Like :func:`select_cold_sample`, but a request whose prefix the engine reused is
    a sample too when the engine said exactly how much it reused: alone on the worker, its
    TTFT ≈ C(N) − C(cached). Traces where every prompt shares a system prompt (Mooncake:
    every request starts with the same block) have no fully cold request after the first.

    Unknown reuse (the engine never says): by the rule of :func:`select_cold_sample` for
    engines without KV events (never-seen prefix, idle worker), and also when the
    approximate view credited at most 1/``NEAR_COLD_SHARE`` of the prompt, with that credit
    as the cached part ("nearly cold": a shared system prompt would otherwise leave such an
    engine one sample per worker).

    ``in_event_time``: as for :func:`select_cold_sample`.
    """
    kw = {"others_running": others_running, "in_event_time": in_event_time}
    cached = graded.engine_cached_tokens
    if cached is None:
        credited = graded.credited_cached_tokens
        if (
            graded.cache_source == CacheSource.APPROXIMATE
            and credited * NEAR_COLD_SHARE <= graded.prompt_tokens
        ):
            probe = msgspec.structs.replace(graded, credited_cached_tokens=0)
            return credited if select_cold_sample(probe, **kw) else None
        return 0 if select_cold_sample(graded, **kw) else None
    if graded.prompt_tokens - cached < MIN_COLD_PROMPT_TOKENS:
        return None  # too few new tokens to measure a prefill
    probe = msgspec.structs.replace(graded, engine_cached_tokens=0)
    return cached if select_cold_sample(probe, **kw) else None
