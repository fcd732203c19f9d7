"""The route service's own settings (``[predictor]`` in the settings file)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from foretoken.core.checks import check_settings_numbers


def _tier_load_costs() -> dict[str, float]:
    return {"CPU": 2e-6, "DISK": 1e-5, "SHARED": 5e-6}


@dataclass(frozen=True, slots=True)
class PredictorConfig:
    # A fraction of would-be rejections admitted anyway (flagged explore): false alarms
    # measured directly.
    explore_fraction: float = 0.02
    # Without a bound, a request is rejected when the best worker's queue wait exceeds this.
    overload_wait_s: float = 120.0
    # A conversation stays on its worker while that costs at most this much more.
    stickiness_margin_s: float = 0.5
    min_retry_after_s: float = 0.5
    max_retry_after_s: float = 120.0
    # Output tokens assumed for a request that names no max_tokens, until answers without
    # one were seen (learn_output_lengths).
    default_output_tokens: int = 128
    # Learn answers' lengths from completions (core/routing/outputs.py): a max_tokens is a
    # cap, not a length. Off: every request is expected to use its whole cap.
    learn_output_lengths: bool = True
    # Before any answer under a cap was seen: a cap many requests share is a client's
    # setting (an SDK's or app's), not a length — such requests are expected to answer at
    # most this many tokens (0: take every cap as the length until answers are seen).
    cold_output_tokens: int = 512
    # A request sent to a worker with no outcome for this long leaves its queue model.
    outstanding_max_age_s: float = 900.0
    # A decision of this service whose grant has not come back on `grants` within this long
    # leaves its queue model: nobody acted on it (the router publishes the grant of every
    # request it sends, within milliseconds), e.g. a caller that only asked.
    unconfirmed_decision_s: float = 10.0
    decision_memory: int = 100_000
    conversation_memory: int = 100_000
    # Seconds per token to bring an offloaded block back, per tier (configured, not learned).
    tier_load_s_per_token: dict[str, float] = field(default_factory=_tier_load_costs)
    # The learner rule stands aside when more than 1/this of a prompt is cached elsewhere.
    learner_max_cached_share: int = 2
    # Several route replicas (docs/ARCHITECTURE.md "Scale-out"): among the candidates within
    # this many seconds of the best, replica i of n prefers the workers it owns (every n-th
    # of the model's workers by id), so replicas deciding at once spread over near-ties
    # instead of herding onto one idle worker. 0 = off; a single replica never uses it.
    replica_tie_margin_s: float = 0.1
    # A prompt sent to a worker and still held there (waiting, prefilling or decoding)
    # credits the prefix it shares with a new prompt, before its KV events come in
    # (foretoken.core.routing.sent_prefixes).
    credit_sent_prefixes: bool = True
    # A worker is chosen by its predicted TTFT plus this times the delay the new prompt's
    # prefill adds to the prompts already prefilling there (engines that cap each prompt's
    # chunk below the step budget: foretoken.core.routing.predict.placement_delay_s).
    # Those prompts' TTFTs were promised; a burst piled on one worker broke them. 1 would
    # minimise the sum of TTFTs; a promise kept is worth more than a new request's own
    # speed: 4 (1, 2, 4, 8 measured, docs/BENCHMARKS.md).
    placement_delay_weight: float = 4.0
    # On an engine whose prompts share steps, a prediction adds what the prompts sent after
    # the request will prefill beside it, from the worker's recent sends over this window
    # (foretoken.core.routing.sharing). 0: off.
    later_sharing_window_s: float = 60.0
    # A prefill the queue model finished less than the first tokens' lateness ago (their
    # 90th percentile, at most this) is taken as done: its first token is on its way.
    max_first_token_lag_s: float = 0.25
    # The queue model holds running requests' KV blocks against the worker's gpu_blocks.
    model_kv_capacity: bool = True
    # A cached prefix survives until the request starts only where a prompt still held there
    # shares it (its blocks are pinned or freshest): beyond that depth the credit is dropped
    # when the prefill the queue ahead must still compute exceeds the GPU blocks no running
    # sequence reserves (LRU eviction reaches it first; foretoken.core.routing.predict).
    evict_under_pressure: bool = True
    # A held prompt's credit keeps only the depth shared by a holder behind which the prompts
    # sent later, still without a first token, compute no more than the worker's whole GPU
    # pool (its blocks, freed when it finishes, are evicted before a prompt sent now starts);
    # not on a worker with an offload tier. Alone it halved the `small` fleet's cache
    # disagreement but took two routed cells below the best baseline (session 41); with
    # kv_charge_unheld_cache the two make one model of what a held prompt pins, and the quick
    # matrices gain within 1 s and lose a fifth of their underpredictions (docs/BENCHMARKS.md,
    # session 42).
    evict_held_under_pressure: bool = True
    # A credited cached prefix takes KV blocks from the engine's free pool unless a prompt
    # still held there shares it (vLLM charges evictable computed blocks at allocation): the
    # queue model reserves those blocks for the request (foretoken.core.queue.scheduler.KvModel).
    # Off: every credited block counts as shared.
    kv_charge_unheld_cache: bool = True
    # Only a held prompt expected to still run when the request is admitted pins what it
    # shares (one whose output is shorter than the steps the prompts sent after it take
    # has finished by then): foretoken.core.routing.predict.Predictions._held_depths.
    pin_only_running_holders: bool = True
    # A prompt alone on its worker gives prefill samples before its first token, from the
    # time stamps of the KV batches that store its blocks (foretoken.core.routing.kv_progress).
    kv_progress_samples: bool = True
    # A busy worker's consecutive KV batches time its steps' prefill: busy-chain samples
    # of one step each (foretoken.core.cost.kv_steps).
    kv_step_samples: bool = True
    # Each worker's blocks whose depth in their prompt is kept for those samples' quadratic
    # regressor: the last kv_step_blocks to twice that many stored. At 2,048 or 4,096 the
    # demo fleet's Mooncake prompts (up to 6k blocks) lost their prefixes' depths, b was
    # never learned and demo-fast-1's `a` read 1.55x the truth (1.00x at 8,192).
    kv_step_blocks: int = 8192
    # Decode samples less the prefill of prompts whose first token came during the
    # request's decode window, dropped below this share of the raw TPOT.
    decode_windows: bool = True
    decode_min_share: float = 0.1
    # Busy-period prefill samples from chains of consecutive first tokens, each cut once its
    # prompts hold this many step budgets of new tokens (0: one sample per large prompt).
    # Three, not one: a chain's ends carry chunks of prompts outside it, and a one-budget
    # chain read 0.2-3x its prefill (the quick matrix: +1.5 points within 1 s).
    busy_chain_budgets: float = 3.0
    # From this many busy-chain samples on, a chain started on an idle engine waits for its
    # queue to drain (an exact sample); before, it ends at its first step (a quick, rougher
    # one: its steps may carry chunks of prompts sent after it). 0: always wait.
    busy_chain_settle: int = 3
    seed: int = 0
    # Where a candidate's queue is walked: "native" (foretoken_native, bit-identical to the
    # Python walk, used for the fitted curves while it models the queue) or "python".
    queue_walk: Literal["native", "python"] = "native"
    # Calibrated upper quantiles (foretoken.core.cost.quantiles): every grant carries the
    # predicted p90 of its TTFT. With admission_quantile = q, a bound B admits iff the
    # predicted q-quantile meets it — P(TTFT <= B) >= q — instead of the point prediction.
    admission_quantile: float | None = None
    quantile_window: int = 400
    quantile_min_samples: int = 30
    quantile_floor_s: float = 0.1
    quantile_default_factor: float = 1.6
    # The queue-wait part of a worker's predictions lengthened by what its first tokens
    # say (foretoken.core.cost.wait_scale): up to wait_scale_max times, learned over the
    # last wait_scale_window first tokens of requests decided here with a raw wait of at
    # least wait_scale_min_wait_s, shrunk toward 1 by wait_scale_prior pseudo-samples.
    wait_scale: bool = True
    # A worker still on a prior curve (no fit of its own) whose requests wait past their
    # predictions is priced slower by as much (foretoken.core.cost.overdue).
    overdue_scale: bool = True
    wait_scale_window: int = 32
    wait_scale_prior: float = 16.0
    wait_scale_min_wait_s: float = 0.3
    wait_scale_max: float = 2.0

    def __post_init__(self) -> None:
        check_settings_numbers(self)  # NaN passes every comparison below
        if not 0.0 <= self.explore_fraction <= 1.0:
            raise ValueError(f"explore_fraction must be within [0, 1], got {self.explore_fraction}")
        if not 0 < self.min_retry_after_s <= self.max_retry_after_s:
            raise ValueError("need 0 < min_retry_after_s <= max_retry_after_s")
        if self.replica_tie_margin_s < 0 or self.placement_delay_weight < 0:
            raise ValueError("replica_tie_margin_s and placement_delay_weight must be >= 0")
        if min(self.overload_wait_s, self.outstanding_max_age_s, self.unconfirmed_decision_s) <= 0:
            raise ValueError(
                "overload_wait_s, outstanding_max_age_s and unconfirmed_decision_s must be > 0"
            )
        if self.queue_walk not in ("native", "python"):
            raise ValueError(f"queue_walk must be native or python, got {self.queue_walk!r}")
        if self.default_output_tokens < 1 or self.learner_max_cached_share < 1:
            raise ValueError("default_output_tokens and learner_max_cached_share must be >= 1")
        if self.cold_output_tokens < 0:
            raise ValueError("cold_output_tokens must be >= 0 (0: off)")
        if min(self.decision_memory, self.conversation_memory) < 1:
            raise ValueError("decision_memory and conversation_memory must be >= 1")
        if self.admission_quantile is not None and not 0 < self.admission_quantile < 1:
            raise ValueError(f"admission_quantile must be in (0, 1), got {self.admission_quantile}")
        if min(self.quantile_window, self.quantile_min_samples) < 1:
            raise ValueError("quantile_window and quantile_min_samples must be >= 1")
        if self.quantile_floor_s <= 0 or self.quantile_default_factor < 1:
            raise ValueError("need quantile_floor_s > 0 and quantile_default_factor >= 1")
        bad = {t: v for t, v in self.tier_load_s_per_token.items() if v < 0}
        if bad or not set(self.tier_load_s_per_token) <= {"CPU", "DISK", "SHARED"}:
            raise ValueError("tier_load_s_per_token: CPU/DISK/SHARED to seconds >= 0")
