"""Fleet files: the simulated engines of a fleet and their hidden true costs (PRODUCT.md §3).

A fleet file is TOML with one ``[[engines]]`` entry per engine (or per template)::

    name = "small"                      # optional; defaults to the file's stem

    [[engines]]
    id = "small"                        # with count = N: small-0 … small-(N-1)
    count = 2
    model = "sim-small"
    engine = "vllm"
    engine_version = "0.11.0-sim"
    block_size = 16
    kv_hash_algo = "sha256_cbor"        # sha256 | sha256_cbor | xxhash | xxhash_cbor
    eagle = false
    # hash_seed = 123                   # optional; derived from the id when absent

    [engines.kv]                        # capacity per tier, in blocks
    gpu_blocks = 2048
    cpu_blocks = 0                      # 0 = no CPU offload tier
    # shared_blocks = 8192              # optional shared (remote) tier

    [engines.scheduler]                 # what the engine reports (foretoken.wire.records)
    max_num_batched_tokens = 2048
    max_num_seqs = 32
    long_prefill_token_threshold = 0

    [engines.truth]                     # HIDDEN: only the simulator reads this table
    prefill_a_s_per_token = 2.0e-5
    prefill_b_s_per_token2 = 1.0e-9
    ...

    [[schedule]]                        # optional: a change of one engine during a run
    at_s = 600.0                        # virtual seconds from the replay's start
    engine = "small-1"                  # an engine id after count expansion
    engine_version = "0.12.0-sim"       # optional: it re-registers (new config hash)
    [schedule.truth]                    # optional: the true costs that change
    prefill_a_s_per_token = 3.0e-5      # any truth field but seed and noise_sigma

Everything outside ``truth`` is what a real engine would report about itself; the truth is
what the predictor must learn and never reads. A template with ``count = N`` expands into
N engines whose ids are suffixed ``-0 … -(N-1)`` and whose seeds (noise and, when given,
hash) are offset by the replica index so that replicas are not clones.

A ``[[schedule]]`` entry (:class:`ScheduleChange`) changes one engine at ``at_s``: its
true costs from the next step it starts on (a new engine build, a thermal throttle: the
predictor must notice by itself) and, with ``engine_version``, what it reports — the
replay then re-registers the worker with the new version (a new config hash, so a fresh
fit), as a restarted engine would. Errors name the field (``$.schedule[0].engine``).
"""

from __future__ import annotations

import hashlib
import math
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from foretoken.core.checks import U64_MASK
from foretoken.core.types import (
    EngineReport,
    ModelName,
    Tier,
    WorkerId,
    WorkerProfile,
    unknown_scheduler_keys,
)

FLEETS_DIR = Path(__file__).parent / "fleets"
MAX_NOISE_SIGMA = 3.0  # a step 20x its median at one sigma: far past any engine
MAX_COST_S = 3600.0
MAX_COUNT = 4096  # engines of one template (100 million took minutes to expand)
KV_HASH_ALGOS = frozenset({"sha256", "sha256_cbor", "xxhash", "xxhash_cbor"})
SEED_DIGEST_BYTES = 8
CONFIG_HASH_CHARS = 16
LowerTier = Literal["CPU", "SHARED"]


class FleetSpecError(ValueError):
    """A fleet file that cannot be used; the message names the file and what is wrong."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _require_non_negative(**values: float) -> None:
    for name, value in values.items():
        _require(math.isfinite(value) and value >= 0, f"{name} must be finite and >= 0")


class TruthSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The hidden true cost of one engine. Times in seconds.

    A step lasts ``step_overhead_s`` + the prefill of its chunks + the decode of its
    decoding sequences (+ tier loads), times a lognormal noise factor of median 1, plus
    ``stall_s`` with probability ``stall_probability`` per step.
    """

    prefill_a_s_per_token: float
    prefill_b_s_per_token2: float
    step_overhead_s: float = 0.0
    decode_s_per_seq: float = 0.0
    decode_s_per_context_token: float = 0.0
    cpu_load_s_per_token: float = 0.0
    shared_load_s_per_token: float = 0.0
    noise_sigma: float = 0.0
    stall_probability: float = 0.0
    stall_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        _require_non_negative(
            prefill_a_s_per_token=self.prefill_a_s_per_token,
            prefill_b_s_per_token2=self.prefill_b_s_per_token2,
            step_overhead_s=self.step_overhead_s,
            decode_s_per_seq=self.decode_s_per_seq,
            decode_s_per_context_token=self.decode_s_per_context_token,
            cpu_load_s_per_token=self.cpu_load_s_per_token,
            shared_load_s_per_token=self.shared_load_s_per_token,
            noise_sigma=self.noise_sigma,
            stall_s=self.stall_s,
        )
        _require(0.0 <= self.stall_probability <= 1.0, "stall_probability must be in [0, 1]")
        _require(
            self.noise_sigma <= MAX_NOISE_SIGMA,
            f"noise_sigma must be at most {MAX_NOISE_SIGMA} (a lognormal factor's sigma)",
        )
        costs = (self.prefill_a_s_per_token, self.step_overhead_s, self.stall_s)
        _require(max(costs) <= MAX_COST_S, f"per-token, per-step and stall seconds must be at "
                 f"most {MAX_COST_S:g} (a step of days is a unit mistake)")  # fmt: skip
        _require(self.seed >= 0, "seed must be >= 0")
        _require(self.prefill_a_s_per_token > 0 or self.prefill_b_s_per_token2 > 0,
                 "a prefill that costs nothing (prefill_a_s_per_token and "
                 "prefill_b_s_per_token2 both 0) has no capacity to load")  # fmt: skip

    def prefill_s(self, num_tokens: int) -> float:
        """C(N) = a·N + b·N²: the cold prefill time of N tokens."""
        return self.prefill_a_s_per_token * num_tokens + self.prefill_b_s_per_token2 * (
            num_tokens * num_tokens
        )

    def chunk_prefill_s(self, start_token: int, end_token: int) -> float:
        """C(end) − C(start): tokens start..end attend to the whole context before them."""
        return self.prefill_s(end_token) - self.prefill_s(start_token)

    def load_s_per_token(self, tier: LowerTier) -> float:
        return self.cpu_load_s_per_token if tier == "CPU" else self.shared_load_s_per_token

    @property
    def noiseless(self) -> bool:
        return self.noise_sigma == 0.0 and (self.stall_probability == 0.0 or self.stall_s == 0.0)


class KvCapacity(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """KV cache capacity per tier, in blocks of the engine's block size."""

    gpu_blocks: int
    cpu_blocks: int = 0
    shared_blocks: int | None = None

    def __post_init__(self) -> None:
        _require(self.gpu_blocks >= 1, "kv.gpu_blocks must be >= 1")
        _require(self.cpu_blocks >= 0, "kv.cpu_blocks must be >= 0")
        _require(
            self.shared_blocks is None or self.shared_blocks >= 1,
            "kv.shared_blocks must be >= 1 when given",
        )

    def lower_tiers(self) -> tuple[tuple[LowerTier, int], ...]:
        """(tier, capacity) of the offload tiers, fastest first; a GPU eviction spills down."""
        tiers: list[tuple[LowerTier, int]] = []
        if self.cpu_blocks > 0:
            tiers.append(("CPU", self.cpu_blocks))
        if self.shared_blocks is not None:
            tiers.append(("SHARED", self.shared_blocks))
        return tuple(tiers)


class EngineSpec(EngineReport, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One simulated engine: what it reports about itself, plus its hidden ``truth``."""

    id: WorkerId
    model: ModelName
    engine_version: str = "0.11.0-sim"
    kv: KvCapacity
    # Seeds the engine's block-hash chain (vLLM's NONE_HASH); None = derived from the id.
    hash_seed: int | None = None
    truth: TruthSpec

    def __post_init__(self) -> None:
        _require(bool(self.id) and bool(self.model), "id and model must be non-empty")
        _require(self.block_size >= 1, "block_size must be >= 1")
        _require(
            self.kv_hash_algo in KV_HASH_ALGOS,
            f"kv_hash_algo must be one of {sorted(KV_HASH_ALGOS)}, got {self.kv_hash_algo!r}",
        )
        _require(
            self.hash_seed is None or 0 <= self.hash_seed <= U64_MASK,
            "hash_seed must be an unsigned 64-bit int",
        )

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers a registration reports, fastest first."""
        return ("GPU", *(tier for tier, _ in self.kv.lower_tiers()))

    def profile(self, ts: float = 0.0) -> WorkerProfile:
        """What the engine publishes about itself (its registration without endpoints):
        the reported fields, GPU blocks included as vLLM's cache_config_info tells, never
        the truth."""
        return WorkerProfile(
            worker_id=self.id, model=self.model, engine=self.engine,
            engine_version=self.engine_version, block_size=self.block_size,
            scheduler=self.scheduler, kv_hash_algo=self.kv_hash_algo, tiers=self.tiers,
            eagle=self.eagle, gpu_blocks=self.kv.gpu_blocks, config_hash=self.config_hash, ts=ts,
        )  # fmt: skip

    @property
    def effective_hash_seed(self) -> int:
        if self.hash_seed is not None:
            return self.hash_seed
        digest = hashlib.blake2b(self.id.encode(), digest_size=SEED_DIGEST_BYTES).digest()
        return int.from_bytes(digest, "big")

    @property
    def config_hash(self) -> str:
        """A digest of what the engine reports (never the truth): a change starts a fresh fit."""
        public = msgspec.structs.asdict(self)
        for private in _NOT_IN_CONFIG_HASH:
            public.pop(private)
        digest = hashlib.sha256(msgspec.json.encode(public, order="sorted")).hexdigest()
        return digest[:CONFIG_HASH_CHARS]


# The identity, the hash seed and the hidden truth are not configuration a fit depends on.
_NOT_IN_CONFIG_HASH = ("id", "hash_seed", "truth")


class EngineTemplate(EngineSpec, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A fleet-file entry: an engine spec replicated ``count`` times."""

    count: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(1 <= self.count <= MAX_COUNT, f"count must be within 1..{MAX_COUNT}")

    def expand(self) -> tuple[EngineSpec, ...]:
        fields = {name: getattr(self, name) for name in EngineSpec.__struct_fields__}
        if self.count == 1:
            return (EngineSpec(**fields),)
        return tuple(self._replica(fields, index) for index in range(self.count))

    def _replica(self, fields: dict[str, Any], index: int) -> EngineSpec:
        replica = dict(fields)
        replica["id"] = WorkerId(f"{self.id}-{index}")
        replica["truth"] = msgspec.structs.replace(self.truth, seed=self.truth.seed + index)
        if self.hash_seed is not None:
            replica["hash_seed"] = (self.hash_seed + index) & U64_MASK
        return EngineSpec(**replica)


# Truth fields a schedule may not change: the random streams are drawn from them once.
_FIXED_TRUTH = ("seed", "noise_sigma")


class ScheduleChange(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One engine changes at ``at_s`` (module doc): its version and/or true costs."""

    at_s: float
    engine: WorkerId
    engine_version: str | None = None
    truth: dict[str, float] = msgspec.field(default_factory=dict)

    def apply(self, spec: EngineSpec) -> EngineSpec:
        """``spec`` after the change."""
        truth = msgspec.structs.replace(spec.truth, **self.truth) if self.truth else spec.truth
        version = self.engine_version or spec.engine_version
        return msgspec.structs.replace(spec, truth=truth, engine_version=version)

    def check(self, where: str, engines: tuple[EngineSpec, ...]) -> None:
        """Raise :class:`FleetSpecError` naming the field of ``where`` that is wrong."""
        if not (math.isfinite(self.at_s) and self.at_s >= 0):
            raise FleetSpecError(f"{where}.at_s must be finite and >= 0, got {self.at_s}")
        spec = next((e for e in engines if e.id == self.engine), None)
        if spec is None:
            raise FleetSpecError(f"{where}.engine: no engine {self.engine!r} in the fleet "
                                 "(ids after count expansion)")  # fmt: skip
        if self.engine_version is not None and not self.engine_version:
            raise FleetSpecError(f"{where}.engine_version must be non-empty")
        known = set(TruthSpec.__struct_fields__) - set(_FIXED_TRUTH)
        for key in self.truth:
            if key not in known:
                raise FleetSpecError(f"{where}.truth.{key}: not a truth field a schedule may "
                                     f"change (one of {sorted(known)})")  # fmt: skip
        try:
            self.apply(spec)
        except (ValueError, TypeError) as exc:
            raise FleetSpecError(f"{where}.truth: {exc}") from exc


class _FleetFile(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    name: str = ""
    engines: tuple[EngineTemplate, ...]
    schedule: tuple[ScheduleChange, ...] = ()


class FleetSpec(msgspec.Struct, kw_only=True, frozen=True):
    """A loaded fleet: every engine expanded, ids unique; its schedule in time order."""

    name: str
    engines: tuple[EngineSpec, ...]
    schedule: tuple[ScheduleChange, ...] = ()

    def engine(self, worker_id: str) -> EngineSpec:
        for spec in self.engines:
            if spec.id == worker_id:
                return spec
        raise KeyError(f"no engine {worker_id!r} in fleet {self.name!r}")

    def models(self) -> tuple[ModelName, ...]:
        return tuple(dict.fromkeys(spec.model for spec in self.engines))

    def engines_for(self, model: str) -> tuple[EngineSpec, ...]:
        return tuple(spec for spec in self.engines if spec.model == model)


def _check_scheduler_keys(raw: dict[str, Any]) -> None:
    """SchedulerSettings (a wire struct) tolerates unknown keys; a fleet file must not."""
    for index, entry in enumerate(raw.get("engines", ())):
        scheduler = entry.get("scheduler") if isinstance(entry, dict) else None
        if isinstance(scheduler, dict):
            unknown = unknown_scheduler_keys(scheduler)
            if unknown:
                raise FleetSpecError(
                    f"unknown scheduler setting(s) {unknown} - at `$.engines[{index}].scheduler`"
                )


def fleet_from_mapping(raw: dict[str, Any], default_name: str = "fleet") -> FleetSpec:
    """Validate a parsed fleet file and expand its templates."""
    _check_scheduler_keys(raw)
    try:
        parsed = msgspec.convert(raw, _FleetFile)
    except msgspec.ValidationError as exc:
        raise FleetSpecError(str(exc)) from exc
    if not parsed.engines:
        raise FleetSpecError("a fleet needs at least one [[engines]] entry")
    engines = tuple(spec for template in parsed.engines for spec in template.expand())
    seen: set[str] = set()
    for spec in engines:
        if spec.id in seen:
            raise FleetSpecError(f"duplicate engine id {spec.id!r} (after count expansion)")
        seen.add(spec.id)
    for index, change in enumerate(parsed.schedule):
        change.check(f"$.schedule[{index}]", engines)
    schedule = tuple(sorted(parsed.schedule, key=lambda c: c.at_s))
    return FleetSpec(name=parsed.name or default_name, engines=engines, schedule=schedule)


def parse_fleet(text: str, source: str = "<string>") -> FleetSpec:
    """Parse fleet TOML text; errors name ``source``."""
    try:
        raw = tomllib.loads(text)
        return fleet_from_mapping(raw, default_name=Path(source).stem or "fleet")
    except tomllib.TOMLDecodeError as exc:
        raise FleetSpecError(f"{source}: not valid TOML: {exc}") from exc
    except FleetSpecError as exc:
        raise FleetSpecError(f"{source}: {exc}") from exc


def load_fleet(path: str | Path) -> FleetSpec:
    """Load a fleet file by path, or a shipped fleet by name (``small``, ``hetero``, ``demo``)."""
    candidate = Path(path)
    if not candidate.exists() and candidate.suffix == "" and len(candidate.parts) == 1:
        candidate = FLEETS_DIR / f"{candidate.name}.toml"
    try:
        text = candidate.read_text(encoding="utf-8-sig")  # a BOM is no error
    except OSError as exc:
        raise FleetSpecError(f"{candidate}: cannot read fleet file: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise FleetSpecError(f"{candidate}: a fleet file is UTF-8 text: {exc}") from exc
    return parse_fleet(text, source=str(candidate))


def shipped_fleets() -> tuple[str, ...]:
    """Names of the fleets shipped in ``fleet/fleets/``."""
    return tuple(sorted(path.stem for path in FLEETS_DIR.glob("*.toml")))
