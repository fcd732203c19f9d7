"""Predictions: for every worker that could serve a request, TTFT = queue wait + own
prefill (PRODUCT.md §1), from the cache index (what is cached where), the worker's fits (how
fast it prefills) and its queue model (what is ahead, walked through the engine's step
scheduler with the settings the worker reported)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import msgspec
import numpy as np

from foretoken.core.cost.fit import PrefillCurve, StepCost
from foretoken.core.cost.overdue import Overdue
from foretoken.core.cost.registry import FitRegistry
from foretoken.core.cost.tier_costs import TierCosts
from foretoken.core.cost.wait_scale import WaitScale, WaitScaleConfig
from foretoken.core.index import content_hash
from foretoken.core.index.protocol import Index
from foretoken.core.index.state import CacheHit
from foretoken.core.queue.scheduler import CurveStepCost, NewRequest
from foretoken.core.routing.config import PredictorConfig
from foretoken.core.routing.fleet import WorkerBook
from foretoken.core.routing.health import WorkerHealth
from foretoken.core.routing.sent_prefixes import SentPrefixes
from foretoken.core.types import (
    LOWER_TIERS,
    CacheSource,
    CandidatePrediction,
    ModelName,
    SchedulerSettings,
    Tier,
    WorkerId,
    WorkerProfile,
)

SLOWEST_FIRST: tuple[Tier, ...] = ("SHARED", "DISK", "CPU", "GPU")


def shared_depth(held: np.ndarray, chain: np.ndarray, top: int) -> int:
    """How many leading blocks (at most ``top``) two own-hash chains share. Chains are
    prefix-closed (block ``i``'s hash commits to blocks ``0..i``), so equal hashes at ``i``
    mean equal prefixes up to ``i``: a binary search of scalar compares (~1 µs for a
    2,048-block chain, against ~6 µs for comparing the arrays whole)."""
    top = min(len(held), len(chain), top)
    if top <= 0 or held[0] != chain[0]:
        return 0
    if held[top - 1] == chain[top - 1]:
        return top
    low, high = 1, top - 1  # held[:low] == chain[:low]; the answer is in [low, high]
    while low < high:
        mid = (low + high + 1) // 2
        if held[mid - 1] == chain[mid - 1]:
            low = mid
        else:
            high = mid - 1
    return low


def deepest_tier(hit: CacheHit) -> Tier | None:
    """The slowest tier the hit reads from (the first of ``SLOWEST_FIRST`` it holds)."""
    if hit.shared_tokens:
        return "SHARED"
    if hit.disk_tokens:
        return "DISK"
    if hit.cpu_tokens:
        return "CPU"
    return "GPU" if hit.gpu_tokens else None


class Candidate(msgspec.Struct, frozen=True, gc=False):
    prediction: CandidatePrediction
    cached_tokens: int
    # The one lower tier the credit reads from and its tokens (None: none, or several).
    lower: tuple[Tier, int] | None = None
    # The prompt's own block hashes for this worker's block size (None: no token ids).
    chain: np.ndarray | None = None
    # Seconds its prefill would add to the first tokens of the prompts already there
    # (:func:`placement_delay_s`): what choosing this worker costs the others.
    delay_s: float = 0.0
    # Of cached_tokens, those a prompt still held there shares (the rest take KV blocks
    # from the engine's free pool); -1: all of them (kv_charge_unheld_cache off).
    pinned_tokens: int = -1
    # Seconds the prompts sent after it will add to its prefill by sharing its steps
    # (:mod:`foretoken.core.routing.sharing`), within the prediction's prefill_s.
    later_s: float = 0.0


def shares_steps(settings: SchedulerSettings) -> bool:
    """Whether prompts prefill side by side there: chunked, each chunk capped below the
    step budget."""
    cap = settings.long_prefill_token_threshold
    return settings.chunked_prefill and 0 < cap < settings.max_num_batched_tokens


def placement_delay_s(settings: SchedulerSettings, lefts: list[int], u: int, a: float) -> float:
    """Prefill seconds a new prompt of ``u`` new tokens adds to the first tokens of the
    prompts without one on an engine that caps each prompt's chunk below its step budget
    (``long_prefill_token_threshold``): there several prompts prefill side by side, a chunk
    of each per step, and every step the new one shares lengthens by its chunk, so a prompt
    with ``left`` tokens to go waits ``a·min(left, u)`` longer. With more such prompts than
    the budget has chunks, the new one starts once all but ``budget // cap − 1`` of them
    are done (FIFO), and delays only those. Without a cap the engine prefills in arrival
    order and a new prompt delays nobody ahead of it: 0."""
    if not shares_steps(settings) or not lefts or u <= 0:
        return 0.0
    slots = max(settings.max_num_batched_tokens // settings.long_prefill_token_threshold, 1)
    ahead = sorted(lefts)
    if len(ahead) >= slots:
        done = ahead[len(ahead) - slots]
        ahead = [left - done for left in ahead[len(ahead) - slots + 1 :]]
    return a * sum(min(left, u) for left in ahead)


def step_cost(fits: FitRegistry, worker: WorkerId, native: bool = True) -> CurveStepCost:
    """The worker's learned cost of an engine step (prefill curve, overhead, decode);
    ``native=False``: a cost only the Python queue walk takes (its recorded future is a
    :class:`~foretoken.core.queue.future.Future`, whose stretches can be inspected)."""
    return _step_cost(fits.curve(worker), fits.step_cost(worker), native)


def _step_cost(curve: PrefillCurve, step: StepCost, native: bool = True) -> CurveStepCost:
    quadratic = _quadratic(curve) if native else None
    return CurveStepCost(curve.cost_s, step.overhead_s, step.per_seq_s, quadratic)


# Prompt sizes at which a curve's cost must be n·(a + b·n) to the bit for the native walk.
_PROBES = (1, 16, 1000, 8192, 131_072)


def _quadratic(curve: PrefillCurve) -> tuple[float, float] | None:
    """``(a, b)`` when ``curve.cost_s(n)`` is ``n·(a + b·n)``, as the native queue walk
    computes it (:mod:`foretoken.core.queue.native_walk`); None for a curve that is not (a
    curve model with another term is walked by the Python reference)."""
    a, b = curve.a, curve.b
    if type(curve) is not PrefillCurve or any(curve.cost_s(n) != n * (a + b * n) for n in _PROBES):
        return None
    return (a, b)


class Predictions:
    """Every candidate's prediction, from the index, the fits and the worker book."""

    def __init__(
        self, index: Index, fits: FitRegistry, book: WorkerBook, config: PredictorConfig
    ) -> None:
        self.index, self.fits, self.book, self.config = index, fits, book, config
        self.tier_costs = TierCosts(config.tier_load_s_per_token)
        self.wait_scale: WaitScale | None = None
        if config.wait_scale:
            self.wait_scale = WaitScale(WaitScaleConfig(
                window=config.wait_scale_window, prior=config.wait_scale_prior,
                min_wait_s=config.wait_scale_min_wait_s, max_scale=config.wait_scale_max,
                memory=config.decision_memory,
            ))  # fmt: skip
        # a cold worker's requests still waiting past their prediction (cost.overdue)
        self.overdue: Overdue | None = Overdue() if config.overdue_scale else None
        # prompts sent and still held by their worker's engine (a credit the index lacks)
        self.sent = SentPrefixes(native=index.backend == "native")
        # workers that stopped answering (the router said so): out of the candidates a while
        self.health = WorkerHealth()
        # per worker: the step cost built for its current (curve, step) fit values
        self._costs: dict[WorkerId, tuple[PrefillCurve, StepCost, CurveStepCost]] = {}
        # predictions that raised (a queue model a bad record left unusable): that worker
        # is no candidate for this request, the others still are; the last reason each
        self.failures = 0
        self.last_failure: dict[WorkerId, str] = {}

    def _cost(self, wid: WorkerId, curve: PrefillCurve, step: StepCost) -> CurveStepCost:
        known = self._costs.get(wid)
        if known is not None and known[0] is curve and known[1] is step:
            return known[2]
        cost = _step_cost(curve, step, self.config.queue_walk == "native")
        self._costs[wid] = (curve, step, cost)
        return cost

    def candidates(
        self,
        model: ModelName,
        tokens: Sequence[int] | np.ndarray,
        now_s: float,
        prompt_tokens: int | None,
        output_tokens: int = 1,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> list[Candidate]:
        """Every worker's prediction for the prompt. A ``cache_salt`` keys its first block
        as the engine keys it (``content_hash.salt_key``): a salted prompt is credited only
        with blocks stored under the same salt. A ``lora_name`` is served by the workers
        that have that adapter, and its blocks are the adapter's (the chain's seed)."""
        n = len(tokens) if len(tokens) else (prompt_tokens or 0)
        self.index.age(now_s)  # approximate views forget what their TTL says is gone
        serving = [p for p in self.book.of_model(model)
                   if lora_name is None or lora_name in p.lora_adapters]  # fmt: skip
        answering = [p for p in serving if not self.health.is_out(p.worker_id, now_s)]
        serving = answering or serving  # every one out: an outage, not a reason to refuse
        profiles = [p for p in serving if p.fits_prompt(n)]
        chains: dict[int, np.ndarray] = {}
        hits: dict[WorkerId, CacheHit] = {}
        held: dict[WorkerId, int] = {}
        salted = (content_hash.salt_key(cache_salt),) if cache_salt else ()
        if len(tokens):  # hashed once per block size: the lookup, the held prompts, _apply
            for size in {p.block_size for p in serving}:
                chains[size] = self.index.hash_prompt(model, size, tokens, lora_name=lora_name,
                                                      extra_keys=salted)  # fmt: skip
            hits = self.index.lookup(model, own_hashes=chains, lora_name=lora_name)
            if self.config.credit_sent_prefixes and len(self.sent):
                for size, chain in chains.items():
                    same = [p.worker_id for p in profiles if p.block_size == size]
                    held |= self.sent.depths(chain, (n - 1) // size, same)
        out: list[Candidate] = []
        for profile in profiles:
            try:
                out.append(self._one(profile, hits.get(profile.worker_id), n, now_s,
                                     output_tokens, chains.get(profile.block_size),
                                     held.get(profile.worker_id, 0)))  # fmt: skip
            except (ValueError, ArithmeticError) as exc:
                self.failures += 1
                self.last_failure[profile.worker_id] = f"{type(exc).__name__}: {exc}"[:300]
        return out

    def _held_depths(self, profile: WorkerProfile, chain: np.ndarray,
                     depth: int) -> tuple[int, int]:  # fmt: skip
        """Of ``chain``'s first ``depth`` blocks (its share with prompts held there), how
        many are (1) still in the GPU tier when a prompt sent now starts, and (2) pinned
        then by a held prompt still running, so that they cost it no KV blocks. One walk of
        the held prompts, newest first, with ``behind`` the uncached tokens sent after each
        and still without a first token:

        1. a held prompt's blocks are freed when it finishes, at the fresh end of the
           engine's LRU, and evicted once the prompts sent after it compute more than the
           whole GPU pool: the deepest share of a holder with no more than that behind it
           (not on a worker with an offload tier: evicted blocks are reused from there);
        2. a holder is admitted before the new prompt (FIFO) and runs its own output's
           steps, while ``behind`` takes at least ``behind / max_num_batched_tokens`` steps
           before the new prompt is admitted: a holder whose expected output is shorter has
           finished by then, its blocks back in the free pool. At most (1)."""
        evicts = bool(self.config.evict_held_under_pressure and profile.gpu_blocks
                      and len(profile.tiers) <= 1)  # fmt: skip
        pins = self.config.pin_only_running_holders
        if not (evicts or pins):
            return depth, depth
        pool = (profile.gpu_blocks or 0) * profile.block_size
        budget = max(profile.scheduler.max_num_batched_tokens, 1)
        queue = self.book.queues[profile.worker_id]
        behind, surviving, pinned = 0, (0 if evicts else depth), 0
        open_ = evicts  # the surviving walk goes on
        for rid, held in self.sent.held_at(profile.worker_id):
            entry = queue.get(rid)
            if entry is None:
                continue
            if open_ and behind > pool:
                open_ = False
            runs = pins and behind < budget * entry.expected_output_tokens
            if open_ or runs:
                shared = shared_depth(held, chain, depth)
                if open_:
                    surviving = max(surviving, shared)
                    open_ = surviving < depth
                if runs:
                    pinned = max(pinned, shared)
            if not open_ and (not pins or pinned >= surviving):
                break
            if entry.first_token_s is None:
                behind += entry.prompt_tokens - entry.cached_tokens
        return surviving, min(pinned, surviving) if pins else surviving

    def _one(
        self, profile: WorkerProfile, hit: CacheHit | None, n: int, now_s: float, out: int,
        chain: np.ndarray | None, held_blocks: int = 0,
    ) -> Candidate:  # fmt: skip
        wid = profile.worker_id
        load_s, cached, lower = 0.0, 0, None
        deepest: Tier | None = None
        source = profile.cache_source
        # the engine counts at most (n - 1) // block_size blocks, one less with EAGLE
        pinned_blocks = held_blocks
        if held_blocks and chain is not None:
            held_blocks, pinned_blocks = self._held_depths(profile, chain, held_blocks)
        held = max(held_blocks - profile.eagle, 0) * profile.block_size
        pinned_held = max(pinned_blocks - profile.eagle, 0) * profile.block_size
        if held > 0 and (hit is None or held > hit.tokens):
            # a prompt still held there shares more: it will be in the GPU tier when this
            # one starts (the earlier prompt loads or computes it first)
            hit, cached, deepest = None, held, "GPU"
            if profile.has_kv_events:  # a store-only worker's credit stays "approximate"
                source = CacheSource.SENT
        if hit is not None:
            cached = min(hit.tokens, n)
            if hit.cpu_tokens or hit.disk_tokens or hit.shared_tokens:
                tiers = hit.by_tier()
                costs = self.tier_costs
                load_s = sum(costs.cost(wid, t) * tiers.get(t, 0) for t in LOWER_TIERS)
                used = [(t, tiers[t]) for t in LOWER_TIERS if tiers.get(t, 0) > 0]
                lower = used[0] if len(used) == 1 else None
            deepest = deepest_tier(hit)
        curve, step = self.fits.answer(wid)
        if curve.default and self.overdue is not None:
            slower = self.overdue.factor(wid, now_s)
            if slower > 1.0:  # already slower than its prior says: price it so
                curve = replace(curve, a=curve.a * slower, b=curve.b * slower)
        queue, cost = self.book.queues[wid], self._cost(wid, curve, step)
        pinned = min(pinned_held, cached) if self.config.kv_charge_unheld_cache else -1
        result = queue.predict(NewRequest(n, cached, out, pinned), now_s, cost)
        if (self.config.evict_under_pressure and hit is not None and cached > held
                and profile.gpu_blocks):  # fmt: skip
            free = queue.kv_free_blocks(now_s, cost)
            if free is not None and result.queue_tokens_ahead > free * profile.block_size:
                # evicted before it starts: only what a held prompt pins is still there
                cached, load_s, lower = min(held, cached), 0.0, None
                deepest = "GPU" if cached else None
                pinned = min(pinned_held, cached) if pinned >= 0 else -1
                result = queue.predict(NewRequest(n, cached, out, pinned), now_s, cost)
        delay = 0.0
        if (self.config.placement_delay_weight > 0 and queue.unstarted_count
                and shares_steps(profile.scheduler)):  # fmt: skip
            lefts = queue.prefill_left(now_s, cost)
            delay = placement_delay_s(profile.scheduler, lefts, n - cached, curve.a)
        own, later = curve.own_prefill_s(n, cached), 0.0
        window = self.config.later_sharing_window_s
        if window > 0:  # the prompts sent after it that will share its steps
            pool = profile.gpu_blocks * profile.block_size if profile.gpu_blocks else None
            later = self.book.recent.delay_s(wid, now_s, window, profile.scheduler, curve.a,
                                             n - cached, own, pool)  # fmt: skip
        prefill = own + later + load_s
        ttft = max(result.ttft_s + load_s + later, prefill)
        if self.wait_scale is not None:
            ttft = prefill + self.wait_scale.scaled(wid, ttft - prefill)
        prediction = CandidatePrediction(
            worker_id=wid, predicted_ttft_s=ttft, queue_wait_s=max(0.0, ttft - prefill),
            prefill_s=prefill, cached_tokens=cached, cached_tier=deepest,
            queue_tokens_ahead=result.queue_tokens_ahead,
            approximate_cache=bool(hit is not None and hit.approximate)
            or not profile.has_kv_events,
            cache_source=source,
        )  # fmt: skip
        return Candidate(prediction, cached, lower, chain, delay, pinned, later)
