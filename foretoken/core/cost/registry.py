"""One fit per worker configuration.

* :mod:`foretoken.core.cost.samples` says which observations feed the fits;
* :class:`FitRegistry` keeps one :class:`~foretoken.core.cost.fit.OnlinePrefillFit` and one
  :class:`~foretoken.core.cost.fit.StepCostFit` per ``(worker_id, config_hash)``: a configuration
  change starts fresh fits, the old ones are kept under their own key.

**Pooled priors.** A worker that has no fit of its own yet (a cold start on a worker that
is never idle gets no cold sample for a long time) predicts with the median of the fitted
values of its closest peers — the workers registered with the same configuration hash, else
the same engine and version, else the same model — instead of the conservative default; a
worker whose configuration changed (an upgrade) takes, unless peers of its very
configuration are fitted, the slower of that and its previous configuration's fit (same
model: :meth:`FitRegistry._previous_value`). Its own fit takes over as soon as it has one.
Such a value is still flagged ``default``.
A group's median is computed once per change of the registry (``_generation``, bumped by every
observation, registration and restore; a pooled step cost once per decode sample,
registration or restore) and shared by every worker of the group. Each worker's
(curve, step cost) is itself answered once per change of what it depends on — its own
observations, the pooled values it took — so a route call's candidates mostly read a
remembered answer (``tests/unit/core/cost/test_registry_answers.py`` holds it equal to a
fresh one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from statistics import median
from typing import Final, TypeVar

import msgspec

from foretoken.core.cost.busy_fit import BusyChainFit
from foretoken.core.cost.fit import (
    SNAPSHOT_VERSION,
    FitConfig,
    FitState,
    OnlinePrefillFit,
    PrefillCurve,
    StepCost,
    StepCostFit,
)
from foretoken.core.types import WorkerId, WorkerProfile

# --------------------------------------------------------------------------- registry

V = TypeVar("V", PrefillCurve, StepCost)
# Peers' step costs are ranked by a step with this many sequences decoding (_median_step).
POOL_RUNNING: Final = 16.0
# Two prior curves are compared by their cost of a prompt of this many tokens.
POOL_TOKENS: Final = 8192.0


@dataclass(slots=True)
class WorkerFits:
    """The fits of one (worker, configuration). ``busy`` is the bootstrap fit from
    back-to-back first tokens (:meth:`FitRegistry.observe_busy`), used only while
    ``prefill`` (cold samples) is still on its default; ``progress`` the one from a lone
    prompt's KV stores (:meth:`FitRegistry.observe_progress`), used only while both are.
    Neither is snapshotted."""

    prefill: OnlinePrefillFit
    step: StepCostFit
    introduced: int  # the registry's clock when this configuration was first seen
    busy: OnlinePrefillFit | None = None
    progress: BusyChainFit | None = None

    @property
    def curve(self) -> PrefillCurve:
        return self.curve_with(self.step.cost)

    def curve_with(self, step: StepCost) -> PrefillCurve:
        """The curve, with ``step`` (the step cost the walk adds to it) taken out of its
        samples: a busy chain's always; a cold sample's overheads once ``step`` is learned
        or scaled to the worker's own decode samples (:meth:`FitRegistry._prior_step`), not
        at a bare default or a peer's (taken off at sample time, a default or scaled prior
        made 9 of 294 graded cells worse, against 1; taken off here, where a later step fit
        corrects it, the scaled one brought a profiled predictor from 92.8/89.2% to
        96.7/92.6% within 1 s on the quick matrices and left the cold start's as it was)."""
        known = not step.default or self.step.samples > 0  # learned, or scaled to samples
        cold = self.prefill.with_overhead(step.overhead_s if known else 0.0)
        if not cold.default:
            return cold
        for fit in (self.busy, self.progress):
            if fit is None:
                continue
            value = (
                fit.curve_with(step.overhead_s, step.per_seq_s)
                if isinstance(fit, BusyChainFit)
                else fit.curve
            )
            if not value.default:
                return value
        return cold

    def scaled_prior(self, a: float, b: float) -> tuple[float, float] | None:
        """A prior curve scaled to this configuration's own prefill samples — its cold
        ones, else its busy-chain ones (:meth:`OnlinePrefillFit.scaled`); None without."""
        for fit in (self.prefill, self.busy):
            if isinstance(fit, OnlinePrefillFit) and fit.samples:
                return fit.scaled(a, b)
        return None

    @property
    def source(self) -> str:
        """Which samples the current curve comes from: cold, busy, progress or default."""
        if not self.prefill.curve.default:
            return "cold"
        curve = self.curve
        if curve is self.prefill.curve:
            return "default"
        progress = self.progress
        return "progress" if progress is not None and curve == progress.curve_with(
            self.step.cost.overhead_s, self.step.cost.per_seq_s) else "busy"  # fmt: skip


class _EntryState(msgspec.Struct, frozen=True):
    worker_id: str
    config_hash: str
    introduced: int
    prefill: FitState
    step: FitState


class RegistrySnapshot(msgspec.Struct, frozen=True):
    version: int
    clock: int
    current: dict[str, str]
    registered: list[str]
    entries: list[_EntryState]


_OWN: Final = object()  # an answer that took no pooled value


@dataclass(slots=True)
class _Answer:
    """A worker's remembered (curve, step cost): its observation count when answered, and
    each pooled value it took (``_OWN``: none) with the generation it was last checked at."""

    changes: int
    curve: PrefillCurve
    step: StepCost
    step_pool: object
    step_seen: int
    curve_pool: object
    curve_seen: int


_CURVE_COLUMNS: Final = ("a", "b", "samples", "version", "default", "stderr_a", "stderr_b")
_STEP_COLUMNS: Final = ("overhead_s", "per_seq_s", "stderr_overhead_s", "stderr_per_seq_s")


class FitRegistry:
    """One :class:`OnlinePrefillFit` and :class:`StepCostFit` per ``(worker_id, config_hash)``.

    A worker's *current* configuration is the one its latest registration names
    (:meth:`apply_registration`); for a worker never registered, the newest configuration
    seen in its samples. A new configuration starts fresh fits; older ones stay under their
    own key (up to ``max_configs_per_worker``), so a late sample from before a restart lands
    in its own configuration's fit, and a revert resumes the old fit.
    """

    def __init__(self, config: FitConfig = FitConfig()) -> None:
        self.config = config
        self._fits: dict[tuple[WorkerId, str], WorkerFits] = {}
        self._current: dict[WorkerId, str] = {}
        self._registered: set[WorkerId] = set()
        # (model, engine, engine version) of each registered worker, for pooled priors
        self._kind: dict[WorkerId, tuple[str, str, str]] = {}
        # each worker's configuration before its current one (same model), a pooled prior
        self._previous: dict[WorkerId, str] = {}
        self._clock = 0
        # pooled medians per (kind of value, peer group), valid while _generation is unchanged
        self._generation = 0
        self._step_generation = 0  # … and by every decode sample, registration and restore
        self._pool_cache: dict[tuple[object, ...], tuple[int, tuple[float, float] | None, int]] = {}
        # per worker: its answered (curve, step cost) and what they were answered at
        self._answers: dict[WorkerId, _Answer] = {}
        self._changes: dict[WorkerId, int] = {}  # observations per worker
        self._default_curve = OnlinePrefillFit(config).curve
        self._default_step = StepCostFit(config).cost

    def apply_registration(self, registration: WorkerProfile) -> None:
        """A registration sets the worker's current configuration; ``removed`` forgets it."""
        self._generation += 1
        self._step_generation += 1
        self._answers.clear()
        worker = registration.worker_id
        if registration.removed:
            for key in [key for key in self._fits if key[0] == worker]:
                del self._fits[key]
            self._current.pop(worker, None)
            self._previous.pop(worker, None)
            self._registered.discard(worker)
            self._kind.pop(worker, None)
            return
        self._registered.add(worker)
        before, kind = self._current.get(worker), self._kind.get(worker)
        if kind is not None and kind[0] != registration.model:
            self._previous.pop(worker, None)  # another model's fits are no prior
        elif before is not None and before != registration.config_hash:
            self._previous[worker] = before
        self._kind[worker] = (registration.model, registration.engine, registration.engine_version)
        self._current[worker] = registration.config_hash
        self._entry(worker, registration.config_hash)

    def observe_cold(
        self, worker_id: WorkerId, config_hash: str, n_tokens: int, seconds: float, ts: float,
        cached_tokens: int = 0, steps: int = 0,
    ) -> bool:  # fmt: skip
        """A prefill sample (:func:`prefill_sample_cached`) that took ``steps`` engine steps
        (their overheads are taken off in the curve, :meth:`WorkerFits.curve_with`); False
        if it was ignored."""
        fit = self._for_sample(worker_id, config_hash).prefill
        return fit.observe(n_tokens, seconds, ts, cached_tokens, steps)

    def observe_busy(
        self, worker_id: WorkerId, config_hash: str, n_tokens: int, seconds: float, ts: float,
        cached_tokens: int = 0,
    ) -> bool:  # fmt: skip
        """A busy-period sample: the time between the worker's previous first token and
        this request's, when it had been queued since before the previous one (the engine
        worked without a pause, the prompt's prefill was most of it). Such samples carry
        other work (decode steps, a chunk done before) and so only bootstrap a worker that
        never gets a cold sample — one that is never idle, from its first request on."""
        fits = self._for_sample(worker_id, config_hash)
        if isinstance(fits.busy, BusyChainFit):  # a chain of one prompt, in its regressors
            k = min(max(cached_tokens, 0), n_tokens)
            return fits.busy.observe_uv(n_tokens - k, n_tokens * n_tokens - k * k, seconds, ts)
        if fits.busy is None:
            fits.busy = OnlinePrefillFit(self.config)
        return fits.busy.observe(n_tokens, seconds, ts, cached_tokens)

    def observe_busy_chain(
        self, worker_id: WorkerId, config_hash: str, u: float, v: float, seconds: float,
        ts: float, steps: int = 0, decoding: float = 0.0, exact: bool = False,
    ) -> bool:  # fmt: skip
        """A busy chain (:mod:`foretoken.core.cost.busy_chains`): consecutive first tokens
        of a never-idle worker, their gaps summed (the fit subtracts ``steps`` steps'
        overhead and decode of ``decoding`` requests at the worker's current step cost),
        and the prompts' regressors ``u = Σ(N − K)``, ``v = Σ(N² − K²)``. Like busy
        samples, it bootstraps a worker without cold samples (it replaces a per-prompt busy
        fit)."""
        fits = self._for_sample(worker_id, config_hash)
        if not isinstance(fits.busy, BusyChainFit):
            fits.busy = BusyChainFit(self.config)
        return fits.busy.observe_uv(u, v, seconds, ts, steps, decoding, exact)

    def observe_progress(
        self, worker_id: WorkerId, config_hash: str, u: float, v: float, seconds: float,
        ts: float, steps: int,
    ) -> bool:  # fmt: skip
        """A lone prompt's partial prefill from its KV stores
        (:mod:`foretoken.core.routing.kv_progress`), as a one-prompt exact chain. Kept
        apart from the busy chains: the samples of one prompt take one chunk per step, so
        its tokens and steps grow together and ``a`` and the step overhead cannot be told
        apart in them — ``a`` comes out short by the default overhead's error per chunk
        (13 against a true 18.6 µs/token on ``random-5``'s 2,048-token chunks, whose true
        overhead is 4 ms against the default's 15). Good enough for the first requests, not
        to teach the curve the queue walk uses for the rest of the run."""
        fits = self._for_sample(worker_id, config_hash)
        if fits.progress is None:
            fits.progress = BusyChainFit(self.config)
        return fits.progress.observe_uv(u, v, seconds, ts, steps, 0.0, True)

    def observe_decode(
        self, worker_id: WorkerId, config_hash: str, tpot_s: float, mean_running: float, ts: float
    ) -> bool:
        """A decode sample (:class:`StepCostFit`); False if it was ignored."""
        self._step_generation += 1
        return self._for_sample(worker_id, config_hash).step.observe(tpot_s, mean_running, ts)

    def _for_sample(self, worker: WorkerId, config_hash: str) -> WorkerFits:
        self._generation += 1  # every observation may change a fit
        self._changes[worker] = self._changes.get(worker, 0) + 1
        new = (worker, config_hash) not in self._fits
        if worker not in self._registered and (new or worker not in self._current):
            self._current[worker] = config_hash
        return self._entry(worker, config_hash)

    def _entry(self, worker: WorkerId, config_hash: str) -> WorkerFits:
        fits = self._fits.get((worker, config_hash))
        if fits is None:
            cfg = self.config
            fits = WorkerFits(OnlinePrefillFit(cfg), StepCostFit(cfg), self._clock)
            self._clock += 1
            self._fits[(worker, config_hash)] = fits
            mine = sorted(
                (f.introduced, key[1]) for key, f in self._fits.items() if key[0] == worker
            )
            keep = {config_hash, self._current.get(worker)}
            excess = len(mine) - self.config.max_configs_per_worker
            for old in [h for _, h in mine if h not in keep][: max(excess, 0)]:
                del self._fits[(worker, old)]
        return fits

    def config_hash(self, worker_id: WorkerId) -> str | None:
        return self._current.get(worker_id)

    def fits(self, worker_id: WorkerId, config_hash: str | None = None) -> WorkerFits | None:
        """A configuration's fits (by default the worker's current one); None if unknown."""
        key = config_hash if config_hash is not None else self._current.get(worker_id)
        return None if key is None else self._fits.get((worker_id, key))

    def curve(self, worker_id: WorkerId) -> PrefillCurve:
        """The worker's current prefill curve (pooled, else the default, for a worker
        without a fit of its own)."""
        return self.answer(worker_id)[0]

    def step_cost(self, worker_id: WorkerId) -> StepCost:
        return self.answer(worker_id)[1]

    def answer(self, worker_id: WorkerId) -> tuple[PrefillCurve, StepCost]:
        """The worker's (curve, step cost), answered again only when what they depend on
        changed: its own fits (an observation of the worker) or a pooled value it took
        (read again only when the registry changed since it was last checked)."""
        known = self._answers.get(worker_id)
        if known is not None and known.changes == self._changes.get(worker_id, 0):
            if known.step_pool is not _OWN and known.step_seen != self._step_generation:
                if known.step_pool != self._pooled_step(worker_id):
                    known = None
                else:
                    known.step_seen = self._step_generation
            if (
                known is not None
                and known.curve_pool is not _OWN
                and known.curve_seen != self._generation
            ):
                if known.curve_pool != self._pooled_curve(worker_id):
                    known = None
                else:
                    known.curve_seen = self._generation
            if known is not None:
                return known.curve, known.step
        answer = self._answer_afresh(worker_id)
        self._answers[worker_id] = answer
        return answer.curve, answer.step

    def _answer_afresh(self, worker_id: WorkerId) -> _Answer:
        pooling = self.config.pooled_priors
        step, step_pool = self._prior_step(worker_id)
        fits = self.fits(worker_id)
        curve = self._default_curve if fits is None else fits.curve_with(step)
        curve_pool: object = _OWN
        if curve.default:
            prior: tuple[float, float] | None = None
            if pooling:
                curve_pool = prior = self._pooled_curve(worker_id)
            if fits is not None and self.config.scale_prior_to_samples:
                scaled = fits.scaled_prior(*(prior or (curve.a, curve.b)))
                prior = scaled or prior
            if prior is not None:
                curve = replace(curve, a=prior[0], b=prior[1])
        changes = self._changes.get(worker_id, 0)
        return _Answer(changes, curve, step, step_pool, self._step_generation, curve_pool,
                       self._generation)  # fmt: skip

    def _pooled_step(self, worker_id: WorkerId) -> tuple[float, float] | None:
        return self._pooled(worker_id, "step", self.own_step_cost, _median_step)

    def _pooled_curve(self, worker_id: WorkerId) -> tuple[float, float] | None:
        return self._pooled(worker_id, "curve", self.own_curve, _median_curve)

    def _prior_step(self, worker_id: WorkerId) -> tuple[StepCost, object]:
        """The worker's step cost, and the pooled value it took (``_OWN`` if none): its own
        fit; before it has one, the peers' pooled value (else the default) scaled to its
        own decode samples (:meth:`StepCostFit.scaled`), still marked default."""
        step = self.own_step_cost(worker_id)
        if not step.default:
            return step, _OWN
        pool: object = _OWN
        prior = None
        if self.config.pooled_priors:
            pool = prior = self._pooled_step(worker_id)
        fits = self.fits(worker_id)
        base = prior if prior is not None else (step.overhead_s, step.per_seq_s)
        value = fits.step.scaled(*base) if fits is not None else None
        value = value if value is not None else prior
        if value is not None:
            step = replace(step, overhead_s=value[0], per_seq_s=value[1])
        return step, pool

    def own_curve(self, worker_id: WorkerId) -> PrefillCurve:
        """The worker's own current prefill curve (the default without a fit)."""
        fits = self.fits(worker_id)
        return (
            self._default_curve if fits is None else fits.curve_with(self._prior_step(worker_id)[0])
        )

    def busy_chain_samples(self, worker_id: WorkerId) -> int:
        """How many busy-chain samples the worker's current configuration's fit holds."""
        fits = self.fits(worker_id)
        busy = None if fits is None else fits.busy
        return busy.samples if isinstance(busy, BusyChainFit) else 0

    def has_cold_fit(self, worker_id: WorkerId) -> bool:
        """Whether the worker's current configuration has a fit from cold samples."""
        fits = self.fits(worker_id)
        return fits is not None and not fits.prefill.curve.default

    def own_step_cost(self, worker_id: WorkerId) -> StepCost:
        fits = self.fits(worker_id)
        return self._default_step if fits is None else fits.step.cost

    def peers(self, worker_id: WorkerId) -> list[list[WorkerId]]:
        """Registered peers, closest group first: same configuration hash, same engine
        and version (and model), same model."""
        kind = self._kind.get(worker_id)
        if kind is None:
            return []
        mine = self._current.get(worker_id)
        others = [w for w in self._kind if w != worker_id and self._kind[w][0] == kind[0]]
        return [
            [w for w in others if self._current.get(w) == mine],
            [w for w in others if self._kind[w] == kind],
            others,
        ]

    def _pooled(
        self, worker_id: WorkerId, what: str, own: Callable[[WorkerId], V],
        combine: Callable[[list[V]], tuple[float, float]],
    ) -> tuple[float, float] | None:  # fmt: skip
        """The median (``combine``) of the closest peer group with fitted values. Only
        called for a worker without a fit of its own, so whether the group includes it does not
        change the median: the value is one per group (model, configuration / engine), cached
        until the registry changes (a step cost's until a decode sample, a registration or a
        restore: nothing else changes a step fit or a group)."""
        kind = self._kind.get(worker_id)
        if kind is None:
            return None
        generation = self._step_generation if what == "step" else self._generation
        key = (what, kind, self._current.get(worker_id))
        known = self._pool_cache.get(key)
        if known is None or known[0] != generation:
            known = (generation, None, -1)
            for index, group in enumerate(self.peers(worker_id)):
                fitted = [v for v in map(own, group) if not v.default]
                if fitted:
                    known = (generation, combine(fitted), index)
                    break
            self._pool_cache[key] = known
        previous = None if known[2] == 0 else self._previous_value(worker_id, what, combine)
        if previous is None or known[1] is None:
            return previous or known[1]
        return max(previous, known[1], key=_step_cost if what == "step" else _prefill_cost)

    def _previous_value(
        self, worker_id: WorkerId, what: str, combine: Callable[[list[V]], tuple[float, float]]
    ) -> tuple[float, float] | None:
        """The fitted value of the worker's previous configuration (same model). After
        peers of the very same configuration, a new configuration's prior is the slower of
        it and the other peers' (an upgrade moves a worker's speed by tens of percent, the
        model's other workers may be other GPUs; priced at the faster one, a worker that
        is slow draws a burst: random-7, an upgraded worker 1.35x slower than before took
        the median of 3.8x faster peers and drew a burst that waited 5 s beyond its
        predictions — too slow a prior only sends it fewer requests until its first
        samples scale the prior)."""
        config = self._previous.get(worker_id)
        fits = None if config is None else self._fits.get((worker_id, config))
        if fits is None:
            return None
        value = fits.step.cost if what == "step" else fits.curve_with(fits.step.cost)
        return None if value.default else combine([value])  # type: ignore[list-item]

    def describe(self) -> list[dict[str, object]]:
        """One row per (worker, configuration), newest configuration first, for a web page."""
        rows: list[dict[str, object]] = []
        ordered = sorted(self._fits.items(), key=lambda kv: (kv[0][0], -kv[1].introduced))
        for (worker, config_hash), fits in ordered:
            current = self._current.get(worker) == config_hash
            step = self._prior_step(worker)[0] if current else fits.step.cost
            curve, step = fits.curve_with(step), fits.step.cost
            row: dict[str, object] = {"worker_id": worker, "config_hash": config_hash}
            row |= {"current": current, "observed": fits.prefill.observed}
            row |= {"source": fits.source, "busy_observed": fits.busy.observed if fits.busy else 0}
            busy = fits.busy
            row["busy_exact"] = busy.exact_samples if isinstance(busy, BusyChainFit) else 0
            row |= {name: getattr(curve, name) for name in _CURVE_COLUMNS}
            row |= {name: getattr(step, name) for name in _STEP_COLUMNS}
            row |= {"step_samples": step.samples, "step_default": step.default}
            rows.append(row)
        return rows

    def snapshot(self) -> bytes:
        """Everything needed to rebuild the fits (their sample windows), as msgpack."""
        entries = [
            _EntryState(worker, config_hash, f.introduced, f.prefill.state(), f.step.state())
            for (worker, config_hash), f in self._fits.items()
        ]
        current = {str(worker): config_hash for worker, config_hash in self._current.items()}
        snap = RegistrySnapshot(
            SNAPSHOT_VERSION, self._clock, current, sorted(self._registered), entries
        )
        return msgspec.msgpack.encode(snap)

    def restore(self, data: bytes) -> None:
        """Replace this registry's state with a snapshot's (refitting the stored windows)."""
        snap = msgspec.msgpack.decode(data, type=RegistrySnapshot)
        if snap.version != SNAPSHOT_VERSION:
            raise ValueError(f"unsupported fit snapshot version {snap.version}")
        self._generation += 1
        self._step_generation += 1
        self._answers.clear()
        self._fits = {}
        for e in snap.entries:
            fits = WorkerFits(OnlinePrefillFit(self.config), StepCostFit(self.config), e.introduced)
            fits.prefill.load_state(e.prefill)
            fits.step.load_state(e.step)
            self._fits[(WorkerId(e.worker_id), e.config_hash)] = fits
        self._current = {WorkerId(w): h for w, h in snap.current.items()}
        self._registered = {WorkerId(w) for w in snap.registered}
        self._clock = snap.clock


def _prefill_cost(curve: tuple[float, float]) -> float:
    """A prior curve's cost of a mid-sized prompt (which of two priors is slower)."""
    return curve[0] * POOL_TOKENS + curve[1] * POOL_TOKENS * POOL_TOKENS


def _step_cost(step: tuple[float, float]) -> float:
    return step[0] + step[1] * POOL_RUNNING


def _median_curve(fitted: list[PrefillCurve]) -> tuple[float, float]:
    """A peer group's curve: the median of each coefficient."""
    return median(v.a for v in fitted), median(v.b for v in fitted)


def _median_step(fitted: list[StepCost]) -> tuple[float, float]:
    """A peer group's step cost: the whole pair of the peer whose step at
    :data:`POOL_RUNNING` sequences is the median. Overhead and per-sequence cost trade off
    against each other in a fit whose samples span few running counts, so medians taken
    apart could pair one peer's high overhead with another's high per-sequence cost, a step
    slower than any peer's."""
    chosen = sorted(fitted, key=lambda v: v.decode_step_s(POOL_RUNNING))[(len(fitted) - 1) // 2]
    return chosen.overhead_s, chosen.per_seq_s
