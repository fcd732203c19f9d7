"""Seeded generated workloads and fleets, for an accuracy matrix that no one trace can
overfit (issue 15).

**Workloads** (:data:`WORKLOADS`) are lists of :class:`~foretoken.sim.traces.TraceRequest`
at "speedup 1" (one request a second on average; the replay divides arrivals by a
calibrated speedup), built from the trace module's generators:

* ``poisson-long``: Poisson arrivals, lognormal prompts of mean ≈ 15k tokens (σ 0.8,
  512 … 120k), nothing shared;
* ``bursty``: gamma gaps of shape 0.15 (coefficient of variation ≈ 2.6: bursts), prompts
  of mean ≈ 4k, light sharing (30% of sessions start with a 512 or 1k system prompt, 10%
  follow-ups);
* ``shared-system``: many sessions, every one starting with the same 8k-token system
  prompt, half of the requests follow-up turns, prompts of mean ≈ 12k;
* ``mix-1k-200k``: Poisson arrivals, 97% prompts ≈ 1k tokens, 3% ≈ 200k; nothing shared;
* ``decode-heavy``: Poisson arrivals, short prompts (median 1.5k) and long answers (median
  1k, up to 8k tokens: reasoning models), half the sessions with a system prompt, 30%
  follow-ups — queue waits bound by running decodes (seats, KV) more than by prefill.

``scale`` multiplies every prompt length (a fleet whose engines hold fewer tokens gets
shorter prompts: :func:`workload_scale`); the 200k prompts of ``mix-1k-200k`` are never
scaled — where a fleet cannot hold them they are refused (the harness counts them).

**Fleets** (:func:`random_fleet_mapping`) are fleet-file mappings, so they pass the same
validation and template expansion as the shipped TOML files: every cost term of every
engine is drawn independently from the seed (prefill ``a`` and ``b``, step overhead,
decode costs, step budget, chunk threshold, max sequences, block size, GPU and CPU tier
sizes, CPU load cost, noise, stalls), and one engine's version and curve change
mid-run (a ``[[schedule]]`` entry, :class:`~foretoken.sim.spec.ScheduleChange`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from foretoken.core.types import ConversationId, RequestId
from foretoken.sim.spec import FleetSpec, fleet_from_mapping
from foretoken.sim.traces import (
    LengthDistribution,
    SharingModel,
    TraceRequest,
    _segment_key,
    gamma_arrivals,
    synthetic_requests,
)

LONG_SIGMA = 0.8
LONG_MEAN_TOKENS = 15_000
LONG_MEDIAN_TOKENS = int(LONG_MEAN_TOKENS / math.exp(LONG_SIGMA**2 / 2))  # mean = m·e^(σ²/2)
OUTPUT = LengthDistribution(median=128, sigma=0.8, min_tokens=4, max_tokens=1024)
LONG_OUTPUT = LengthDistribution(median=1000, sigma=0.7, min_tokens=64, max_tokens=8192)
SHARED_SYSTEM_TOKENS = 8192
MIX_SHORT_TOKENS = 1000
MIX_LONG_TOKENS = 200_000
MIX_LONG_SHARE = 0.03
_DOMAIN_MIX = 7  # segment-key domain of the 1k/200k mix (the trace module uses 1..3)
MIN_TOKENS = 16
FULL_SCALE_TOKENS = 222_000  # a fleet whose every engine holds this gets unscaled prompts
SMALL_SCALE = 0.15


def _scaled(tokens: float, scale: float, floor: int = MIN_TOKENS) -> int:
    return max(int(tokens * scale), floor)


def poisson_long(n: int, seed: int = 0, scale: float = 1.0) -> list[TraceRequest]:
    """Poisson arrivals (1/s), lognormal prompts of mean ≈ 15k tokens, nothing shared."""
    prompt = LengthDistribution(
        median=_scaled(LONG_MEDIAN_TOKENS, scale), sigma=LONG_SIGMA,
        min_tokens=_scaled(512, scale), max_tokens=_scaled(120_000, scale),
    )  # fmt: skip
    return synthetic_requests(n, rate_rps=1.0, prompt=prompt, output=OUTPUT, burstiness=1.0,
                              sharing=SharingModel.none(seed), seed=seed)  # fmt: skip


def bursty(n: int, seed: int = 0, scale: float = 1.0) -> list[TraceRequest]:
    """Gamma(0.15) gaps (bursts), prompts of mean ≈ 4k, light sharing."""
    prompt = LengthDistribution(
        median=_scaled(3000, scale), sigma=0.8, min_tokens=_scaled(128, scale),
        max_tokens=_scaled(60_000, scale),
    )  # fmt: skip
    sharing = SharingModel(
        system_prompt_tokens=(_scaled(512, scale), _scaled(1024, scale)),
        system_prompt_fraction=0.3, followup_probability=0.1, seed=seed,
    )  # fmt: skip
    return synthetic_requests(n, rate_rps=1.0, prompt=prompt, output=OUTPUT, burstiness=0.15,
                              sharing=sharing, seed=seed)  # fmt: skip


def shared_system(n: int, seed: int = 0, scale: float = 1.0) -> list[TraceRequest]:
    """Every session starts with one long system prompt; half the requests are follow-ups."""
    sys_len = _scaled(SHARED_SYSTEM_TOKENS, scale, 32)
    prompt = LengthDistribution(
        median=max(_scaled(10_000, scale), sys_len + 64), sigma=0.5,
        min_tokens=sys_len + _scaled(256, scale), max_tokens=_scaled(100_000, scale),
    )  # fmt: skip
    sharing = SharingModel(system_prompt_tokens=(sys_len,), system_prompt_fraction=1.0,
                           followup_probability=0.5, session_idle_s=600.0, seed=seed)  # fmt: skip
    return synthetic_requests(n, rate_rps=1.0, prompt=prompt, output=OUTPUT, burstiness=1.0,
                              sharing=sharing, seed=seed)  # fmt: skip


def mix_1k_200k(n: int, seed: int = 0, scale: float = 1.0) -> list[TraceRequest]:
    """Poisson arrivals; 97% prompts ≈ 1k tokens (σ 0.3), 3% ≈ 200k (σ 0.05, never
    scaled: a fleet that cannot hold them refuses them); nothing shared."""
    del scale  # the point of this workload is the 200k prompts
    rng = np.random.default_rng(seed)
    arrivals = gamma_arrivals(1.0, n, 1.0, seed)
    long = rng.random(n) < MIX_LONG_SHARE
    short = np.clip(
        np.rint(MIX_SHORT_TOKENS * np.exp(0.3 * rng.standard_normal(n))), MIN_TOKENS, None
    )
    big = np.clip(np.rint(MIX_LONG_TOKENS * np.exp(0.05 * rng.standard_normal(n))), MIN_TOKENS,
                  1.1 * MIX_LONG_TOKENS)  # fmt: skip
    prompts = np.where(long, big, short).astype(np.int64)
    outputs = OUTPUT.sample(n, rng)
    return [
        TraceRequest(
            request_id=RequestId(f"mix-{i:06d}"),
            arrival_s=float(arrivals[i]),
            prompt_tokens=int(prompts[i]),
            output_tokens=int(outputs[i]),
            segment_keys=(_segment_key(_DOMAIN_MIX, i),),
            segment_lengths=(int(prompts[i]),),
            conversation_id=ConversationId(f"mix-{i:06d}"),
            token_seed=seed,
        )
        for i in range(n)
    ]


def decode_heavy(n: int, seed: int = 0, scale: float = 1.0) -> list[TraceRequest]:
    """Poisson arrivals, short prompts, long answers (``LONG_OUTPUT``), light sharing."""
    prompt = LengthDistribution(
        median=_scaled(1500, scale), sigma=0.8, min_tokens=_scaled(64, scale),
        max_tokens=_scaled(16_000, scale),
    )  # fmt: skip
    sharing = SharingModel(
        system_prompt_tokens=(_scaled(512, scale), _scaled(1024, scale)),
        system_prompt_fraction=0.5, followup_probability=0.3, seed=seed,
    )  # fmt: skip
    return synthetic_requests(n, rate_rps=1.0, prompt=prompt, output=LONG_OUTPUT,
                              burstiness=1.0, sharing=sharing, seed=seed)  # fmt: skip


WORKLOADS: dict[str, Callable[[int, int, float], list[TraceRequest]]] = {
    "poisson-long": poisson_long,
    "bursty": bursty,
    "shared-system": shared_system,
    "mix-1k-200k": mix_1k_200k,
    "decode-heavy": decode_heavy,
}


def fleet_tokens(fleet: FleetSpec) -> int:
    """Prompt + output tokens that every engine of the fleet holds (GPU blocks × block
    size of the smallest one)."""
    return min(spec.kv.gpu_blocks * spec.block_size for spec in fleet.engines)


def workload_scale(fleet: FleetSpec) -> float:
    """1 on fleets whose every engine holds a 222k-token request; else ``SMALL_SCALE``
    (``poisson-long`` then has a mean of ≈ 2.2k tokens: still long against a 1-2k budget)."""
    return 1.0 if fleet_tokens(fleet) >= FULL_SCALE_TOKENS else SMALL_SCALE


# ---------------------------------------------------------------------------- fleets


def _loguniform(rng: np.random.Generator, low: float, high: float) -> float:
    return float(math.exp(rng.uniform(math.log(low), math.log(high))))


def _truth(rng: np.random.Generator, has_cpu: bool, seed: int) -> dict[str, Any]:
    stall_p = float(rng.choice([0.0, 0.0005, 0.002]))
    return {
        "prefill_a_s_per_token": _loguniform(rng, 1.2e-5, 6e-5),
        "prefill_b_s_per_token2": _loguniform(rng, 2e-12, 8e-11),
        "step_overhead_s": _loguniform(rng, 0.004, 0.02),
        "decode_s_per_seq": _loguniform(rng, 5e-5, 3e-4),
        "decode_s_per_context_token": _loguniform(rng, 1e-9, 1e-8),
        "cpu_load_s_per_token": _loguniform(rng, 5e-7, 4e-6) if has_cpu else 0.0,
        "noise_sigma": float(rng.uniform(0.02, 0.12)),
        "stall_probability": stall_p,
        "stall_s": float(rng.uniform(0.1, 0.6)) if stall_p else 0.0,
        "seed": seed,
    }


def _engine(rng: np.random.Generator, seed: int, index: int, model: str,
            min_gpu_tokens: int) -> dict[str, Any]:  # fmt: skip
    budget = int(rng.choice([2048, 4096, 8192, 16384]))
    threshold = int(rng.choice([0, 0, budget // 4, budget // 2]))
    block = int(rng.choice([16, 32, 64, 128]))
    gpu_blocks = int(_loguniform(rng, min_gpu_tokens, 1_200_000) // block)
    kv: dict[str, Any] = {"gpu_blocks": gpu_blocks}
    has_cpu = bool(rng.random() < 0.5)
    if has_cpu:
        kv["cpu_blocks"] = int(gpu_blocks * rng.uniform(2, 8))
    return {
        "id": f"r{seed}-e{index}", "count": int(rng.choice([1, 2])), "model": model,
        "engine": "vllm", "engine_version": f"0.{10 + index % 2}.0-sim", "block_size": block,
        "kv_hash_algo": str(rng.choice(["sha256_cbor", "xxhash", "sha256"])), "kv": kv,
        "scheduler": {
            "max_num_batched_tokens": budget, "max_num_seqs": int(rng.choice([16, 32, 64, 128])),
            "long_prefill_token_threshold": threshold,
        },
        "truth": _truth(rng, has_cpu, seed * 100 + index),
    }  # fmt: skip


def random_fleet_mapping(
    seed: int, *, engines: int = 4, model: str = "rand-model", min_gpu_tokens: int = 300_000,
    change_at_s: float = 600.0,
) -> dict[str, Any]:  # fmt: skip
    """A seeded random fleet (module doc): ``engines`` templates of 1 or 2 replicas; the
    first engine upgrades at ``change_at_s`` (virtual seconds of the replay) to a new
    version whose prefill is 1.2-1.6× slower or faster and whose step overhead moves."""
    rng = np.random.default_rng(seed)
    entries = [_engine(rng, seed, i, model, min_gpu_tokens) for i in range(engines)]
    first = entries[0]
    worker = first["id"] if first["count"] == 1 else f"{first['id']}-0"
    factor = float(rng.uniform(1.2, 1.6)) ** (1 if rng.random() < 0.5 else -1)
    change = {
        "at_s": change_at_s, "engine": worker, "engine_version": "0.12.0-sim",
        "truth": {
            "prefill_a_s_per_token": first["truth"]["prefill_a_s_per_token"] * factor,
            "prefill_b_s_per_token2": first["truth"]["prefill_b_s_per_token2"] * factor,
            "step_overhead_s": first["truth"]["step_overhead_s"] * float(rng.uniform(0.5, 2.0)),
        },
    }  # fmt: skip
    return {"name": f"random-{seed}", "engines": entries, "schedule": [change]}


def random_fleet(seed: int, **kw: Any) -> FleetSpec:
    return fleet_from_mapping(random_fleet_mapping(seed, **kw), default_name=f"random-{seed}")
