"""What clients send beside their prompts, applied to a trace's requests: a latency bound
per request (:class:`BoundMix`) and a ``max_tokens`` (:class:`MaxTokensModel`).

**max_tokens.** The traces record how many tokens each answer had, not what its client
asked for. Replayed as they are, every client asks for exactly what it gets
(``exact``): a predictor then knows each answer's length in advance, which no router does.
Real clients send a fixed cap (an SDK default, an app's setting), a loose per-request
budget, or nothing; the answer ends at its own end-of-sequence, or at the cap. The
models (``--max-tokens`` of ``foretoken bench predict``):

* ``exact``: the trace as recorded (the client's cap is the answer's length);
* ``cap:N``: every client sends ``N``; answers longer than ``N`` stop there;
* ``none``: no client sends one (the engine stops at the answer's end);
* ``loose``: each request a budget 1-4× its answer's length (rounded up to 64);
* ``mix``: per request, seeded: 25% ``loose``, 50% a fixed cap of 1k, 2k, 4k or 8k
  tokens, 25% none — several kinds of client on one fleet.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from foretoken.sim.traces import TraceRequest

WEIGHT_SUM_TOLERANCE = 1e-6
NO_BOUND_LABEL = "none"
MAX_TOKENS_MODELS = ("exact", "cap:N", "none", "loose", "mix")
LOOSE_RANGE = (1.0, 4.0)
LOOSE_ROUND = 64
MIX_CAPS = (1024, 2048, 4096, 8192)
MIX_SHARES = (0.25, 0.5, 0.25)  # loose, a fixed cap, none


# ---------------------------------------------------------------------------- max_tokens


@dataclass(frozen=True, slots=True)
class MaxTokensModel:
    """How clients set ``max_tokens`` (module doc); ``apply`` is deterministic per request."""

    kind: str = "exact"
    cap: int = 0

    @classmethod
    def parse(cls, text: str) -> MaxTokensModel:
        name, _, value = text.strip().lower().partition(":")
        if name == "cap":
            try:
                cap = int(value)
            except ValueError:
                cap = 0
            if cap < 1:
                raise ValueError(f"--max-tokens {text!r}: cap:N with N a positive integer")
            return cls("cap", cap)
        if name not in ("exact", "none", "loose", "mix") or value:
            raise ValueError(f"--max-tokens {text!r}: one of {', '.join(MAX_TOKENS_MODELS)}")
        return cls(name)

    @property
    def label(self) -> str:
        return f"cap:{self.cap}" if self.kind == "cap" else self.kind

    def apply(self, requests: Sequence[TraceRequest], seed: int = 0) -> list[TraceRequest]:
        if self.kind == "exact":
            return list(requests)
        return [self._one(r, seed) for r in requests]

    def _one(self, request: TraceRequest, seed: int) -> TraceRequest:
        rng = np.random.default_rng([seed, zlib.crc32(request.request_id.encode())])
        kind, cap = self.kind, self.cap
        if kind == "mix":
            pick = rng.random()
            kind = "loose" if pick < MIX_SHARES[0] else (
                "cap" if pick < MIX_SHARES[0] + MIX_SHARES[1] else "none")  # fmt: skip
            cap = int(rng.choice(MIX_CAPS))
        out = request.output_tokens
        if kind == "none":
            return replace(request, max_tokens=0)
        if kind == "loose":
            budget = out * rng.uniform(*LOOSE_RANGE)
            return replace(request, max_tokens=math.ceil(budget / LOOSE_ROUND) * LOOSE_ROUND)
        return replace(request, max_tokens=cap, output_tokens=min(out, cap))


# ---------------------------------------------------------------------------- bounds


@dataclass(frozen=True, slots=True)
class BoundMix:
    """A mix of per-request ``max_queue_wait_s`` values, e.g. ``"5:0.2,30:0.5,none:0.3"``.

    ``assign`` gives each value to exactly its share of the requests (largest remainder
    rounding) in a seeded random order, so a mix is exact and reproducible."""

    bounds: tuple[float | None, ...]
    weights: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.bounds or len(self.bounds) != len(self.weights):
            raise ValueError("a bound mix needs one weight per bound and at least one bound")
        if len(set(self.bounds)) != len(self.bounds):
            raise ValueError("a bound appears twice in the mix")
        if any(b is not None and not (b > 0 and math.isfinite(b)) for b in self.bounds):
            raise ValueError("bounds must be positive finite seconds or none")
        if any(not (w >= 0 and math.isfinite(w)) for w in self.weights):
            raise ValueError("weights must be non-negative")
        if abs(sum(self.weights) - 1.0) > WEIGHT_SUM_TOLERANCE:
            raise ValueError(f"weights must sum to 1, got {sum(self.weights)}")

    @classmethod
    def parse(cls, text: str) -> BoundMix:
        bounds: list[float | None] = []
        weights: list[float] = []
        for item in text.split(","):
            bound_text, sep, weight_text = item.strip().partition(":")
            if not sep or not bound_text.strip() or not weight_text.strip():
                raise ValueError(f"bound mix item {item!r} is not BOUND:WEIGHT")
            try:
                is_none = bound_text.strip().lower() == NO_BOUND_LABEL
                bounds.append(None if is_none else float(bound_text))
                weights.append(float(weight_text))
            except ValueError as exc:
                raise ValueError(f"bound mix item {item!r}: {exc}") from exc
        return cls(tuple(bounds), tuple(weights))

    def draw(self, n: int, seed: int = 0) -> list[float | None]:
        """``n`` bounds with exactly the mix's shares, in a seeded random order."""
        quotas = np.asarray(self.weights) * n
        counts = np.floor(quotas).astype(np.int64)
        shortfall = n - int(counts.sum())
        counts[np.argsort(-(quotas - counts), kind="stable")[:shortfall]] += 1
        order = np.random.default_rng(seed).permutation(n)
        labels = np.repeat(np.arange(len(self.bounds)), counts)[order]
        return [self.bounds[int(k)] for k in labels]

    def assign(self, requests: Sequence[TraceRequest], seed: int = 0) -> list[TraceRequest]:
        return [
            r.with_bound(b) for r, b in zip(requests, self.draw(len(requests), seed), strict=True)
        ]
