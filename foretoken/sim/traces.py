"""Request traces for the fleet simulator and the load generator (PRODUCT.md §3, §5).

Pure: numpy, polars, msgspec and the standard library only. Every loader returns
:class:`TraceRequest` values in arrival order, with ``arrival_s`` measured from the trace
start and already divided by ``speedup``.

**Token ids are built lazily.** A request stores its prompt as *segments*: (key, length)
pairs. Segment ``k`` expands into ``length`` token ids by a keyed hash (splitmix64 of the
expansion seed, the key and the position), so the expansion is a pure function: equal keys
give equal tokens, different keys give different tokens except with probability about
``vocab_size ** -length``. Nothing is cached or held in memory (the Mooncake file alone
is 145 M prompt tokens, ~580 MB as int32); ``TraceRequest.token_ids`` rebuilds a
request's ids with a few in-place numpy passes (~0.25 ms per 10k tokens).

**Mooncake** (``load_mooncake``): each hash id is one segment of ``MOONCAKE_BLOCK_TOKENS``
(512) tokens keyed by the id, the last one truncated to ``input_length``. Conversation id:
every request of the shipped trace starts with the same block (id 0, a system prompt), so
the *first* hash id cannot tell conversations apart; the conversation id is the first hash
id after the leading blocks that all loaded requests share (in the shipped file
``hash_ids[1]``; a request with nothing beyond the shared blocks uses its last block).
Pass ``system_prefix_blocks`` to fix the number of shared leading blocks instead.

**Azure** (``load_azure``, any CSV trace: :mod:`foretoken.sim.trace_csv`): arrivals and
sizes come from the trace; which tokens are shared is synthesized by :class:`SharingModel`
(documented there).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np

from foretoken.core.checks import MAX_PROMPT_TOKENS
from foretoken.core.types import ConversationId, RequestId
from foretoken.sim.trace_csv import TraceFormatError, read_csv_trace

log = logging.getLogger(__name__)

TRACES_DIR_ENV = "FORETOKEN_TRACES_DIR"
MOONCAKE_FILE = "mooncake_conversation_trace.jsonl"
AZURE_CODE_FILE = "azure_llm_inference_2023_code.csv"
AZURE_CONV_FILE = "azure_llm_inference_2023_conv.csv"
MOONCAKE_BLOCK_TOKENS = 512
# Other block sizes a Mooncake-format trace may be written with (hash ids per N tokens).
BLOCK_SIZES = tuple(1 << k for k in range(4, 13))
DEFAULT_VOCAB_SIZE = 32000
MS_PER_S = 1000.0
# Segment keys carry their origin in the high bits so that sources never collide.
_KEY_DOMAIN_SHIFT = 40
_DOMAIN_MOONCAKE = 1
_DOMAIN_SYSTEM_PROMPT = 2
_DOMAIN_UNIQUE = 3
# splitmix64 constants (Steele, Lea & Flood 2014).
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)
_SHIFT_1, _SHIFT_2, _SHIFT_3 = np.uint64(30), np.uint64(27), np.uint64(31)
_HIGH_HALF = np.uint64(32)
# Default synthetic sharing (not measured: a plausible laptop-sized mix, see SharingModel).
DEFAULT_SYSTEM_PROMPT_TOKENS = (256, 512, 1024)
DEFAULT_SYSTEM_PROMPT_FRACTION = 0.5
DEFAULT_FOLLOWUP_PROBABILITY = 0.3
DEFAULT_SESSION_IDLE_S = 600.0
DEFAULT_MAX_OPEN_SESSIONS = 1024
# BoundMix weights must sum to one within this tolerance.


# The traces shipped in the repository (data/traces, with their licenses and a README).
SHIPPED_TRACES_DIR = Path(__file__).resolve().parents[2] / "data" / "traces"


def traces_dir() -> Path:
    """``$FORETOKEN_TRACES_DIR``, else the repository's own ``data/traces``."""
    override = os.environ.get(TRACES_DIR_ENV)
    if override:
        return Path(override).expanduser()
    return SHIPPED_TRACES_DIR


def default_trace_path(name: str) -> Path:
    """A shipped trace file (``MOONCAKE_FILE``, ``AZURE_CODE_FILE``, ``AZURE_CONV_FILE``)."""
    return traces_dir() / name


# ---------------------------------------------------------------------------- tokens


def _splitmix64(x: np.ndarray) -> np.ndarray:
    z = x + _GOLDEN
    z = (z ^ (z >> _SHIFT_1)) * _MIX_1
    z = (z ^ (z >> _SHIFT_2)) * _MIX_2
    return z ^ (z >> _SHIFT_3)


def expand_segments(
    keys: Sequence[int], lengths: Sequence[int], *, seed: int, vocab_size: int
) -> np.ndarray:
    """Token ids (int32, in ``[0, vocab_size)``) of the segments, concatenated.

    Token ``j`` of a segment with key ``k`` is ``splitmix64(base(k) + j·GOLDEN)`` mapped onto
    the vocabulary, with ``base(k) = splitmix64(k ^ splitmix64(seed))``."""
    lens = np.asarray(lengths, dtype=np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int32)
    seed_mix = _splitmix64(np.asarray([seed], dtype=np.uint64))
    bases = _splitmix64(np.asarray(keys, dtype=np.uint64) ^ seed_mix)
    starts = (np.cumsum(lens) - lens).astype(np.uint64)
    # In place: z = base + (index − segment start)·GOLDEN, then one splitmix64 round.
    z = np.arange(total, dtype=np.uint64)
    z *= _GOLDEN
    z += np.repeat(bases - starts * _GOLDEN, lens)
    z += _GOLDEN
    z ^= z >> _SHIFT_1
    z *= _MIX_1
    z ^= z >> _SHIFT_2
    z *= _MIX_2
    z ^= z >> _SHIFT_3
    # Lemire's multiply-shift maps the high 32 bits onto [0, vocab_size) without a modulo.
    z >>= _HIGH_HALF
    z *= np.uint64(vocab_size)
    z >>= _HIGH_HALF
    return z.astype(np.int32)


def _segment_key(domain: int, ident: int) -> int:
    return (domain << _KEY_DOMAIN_SHIFT) | ident


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request to replay. ``token_ids`` is rebuilt from the segments on each access."""

    request_id: RequestId
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    segment_keys: tuple[int, ...]
    segment_lengths: tuple[int, ...]
    conversation_id: ConversationId | None = None
    max_queue_wait_s: float | None = None
    token_seed: int = 0
    vocab_size: int = DEFAULT_VOCAB_SIZE
    workload_class: str = "default"
    # the client's max_tokens: None = its output (it asked for what it got); 0 = none sent
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if len(self.segment_keys) != len(self.segment_lengths):
            raise ValueError(f"{self.request_id}: segment keys and lengths differ in number")
        if sum(self.segment_lengths) != self.prompt_tokens:
            raise ValueError(f"{self.request_id}: segments do not add up to prompt_tokens")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"{self.request_id}: prompt and output need >= 1 token")

    @property
    def token_ids(self) -> np.ndarray:
        """The prompt's token ids (int32, freshly built, ``prompt_tokens`` long)."""
        return expand_segments(
            self.segment_keys,
            self.segment_lengths,
            seed=self.token_seed,
            vocab_size=self.vocab_size,
        )

    def with_bound(self, max_queue_wait_s: float | None) -> TraceRequest:
        return replace(self, max_queue_wait_s=max_queue_wait_s)

    def with_class(self, workload_class: str) -> TraceRequest:
        return replace(self, workload_class=workload_class)

    @property
    def sent_max_tokens(self) -> int | None:
        """What the client sends as max_tokens (None: nothing)."""
        return self.output_tokens if self.max_tokens is None else (self.max_tokens or None)


def _check_speedup(speedup: float) -> None:
    if not speedup > 0 or not math.isfinite(speedup):
        raise ValueError(f"speedup must be a positive finite number, got {speedup}")


# ---------------------------------------------------------------------------- Mooncake


_HASH_ID = Annotated[int, msgspec.Meta(ge=0, lt=1 << _KEY_DOMAIN_SHIFT)]


class _MooncakeRow(msgspec.Struct):
    timestamp: Annotated[float, msgspec.Meta(ge=0.0)]
    input_length: int
    output_length: int
    # a block's id: below the bits a segment key keeps for its domain (a bigger one would
    # alias another trace's block, a negative one was an OverflowError traceback); none:
    # the prompt shares nothing
    hash_ids: list[_HASH_ID] | None = None


def _common_prefix_len(rows: Sequence[list[int]]) -> int:
    if not rows:
        return 0
    prefix = rows[0]
    n = len(prefix)
    for ids in rows[1:]:
        n = min(n, len(ids))
        while n and ids[:n] != prefix[:n]:
            n -= 1
        if n == 0:
            break
    return n


def _fits(row: _MooncakeRow, block: int) -> bool:
    return row.hash_ids is None or len(row.hash_ids) == math.ceil(row.input_length / block)


def _block_tokens(rows: Sequence[_MooncakeRow], lines: Sequence[int], source: Path) -> int:
    """Tokens per hash id: Mooncake's 512, else a power of two every row agrees on."""
    for block in (MOONCAKE_BLOCK_TOKENS, *BLOCK_SIZES):
        if all(_fits(r, block) for r in rows):
            if block != MOONCAKE_BLOCK_TOKENS:
                log.warning("%s: hash ids of %d tokens (not Mooncake's 512)", source, block)
            return block
    i = next(i for i, r in enumerate(rows) if not _fits(r, MOONCAKE_BLOCK_TOKENS))
    n = len(rows[i].hash_ids or ())
    raise TraceFormatError(f"{source}:{lines[i]}: {n} hash ids for {rows[i].input_length} "
                           f"tokens (block size {MOONCAKE_BLOCK_TOKENS}, nor any other one "
                           "that fits every row)")  # fmt: skip


def load_mooncake(
    path: str | Path | None = None,
    *,
    limit: int | None = None,
    speedup: float = 1.0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    system_prefix_blocks: int | None = None,
) -> list[TraceRequest]:
    """Read a Mooncake trace (JSON lines). ``limit`` keeps the first N lines. Rows without
    ``hash_ids`` share nothing; a trace written with another block size is read with it."""
    _check_speedup(speedup)
    source = Path(path) if path is not None else default_trace_path(MOONCAKE_FILE)
    decoder = msgspec.json.Decoder(_MooncakeRow)
    rows: list[_MooncakeRow] = []
    lines: list[int] = []
    try:
        fh = source.open("rb")
    except OSError as exc:
        raise TraceFormatError(f"{source}: {exc.strerror or exc}") from exc
    with fh:
        for line_no, line in enumerate(fh, start=1):
            if limit is not None and len(rows) >= limit:
                break
            line = line.removeprefix(b"\xef\xbb\xbf") if line_no == 1 else line  # BOM
            if not line.strip():
                continue
            try:
                row = decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise TraceFormatError(f"{source}:{line_no}: {exc}") from exc
            if not (1 <= row.input_length <= MAX_PROMPT_TOKENS and row.output_length >= 1):
                raise TraceFormatError(f"{source}:{line_no}: lengths must be >= 1 (a prompt "
                                       f"at most {MAX_PROMPT_TOKENS} tokens)")  # fmt: skip
            if row.hash_ids == []:
                raise TraceFormatError(f"{source}:{line_no}: hash_ids is empty")
            rows.append(row)
            lines.append(line_no)
    block = _block_tokens(rows, lines, source)
    order = sorted(range(len(rows)), key=lambda i: rows[i].timestamp)
    rows = [rows[i] for i in order]
    start_ms = rows[0].timestamp if rows else 0.0  # absolute stamps: from the first one
    with_ids = [r.hash_ids for r in rows if r.hash_ids is not None]
    shared = _common_prefix_len(with_ids) if system_prefix_blocks is None else system_prefix_blocks
    out: list[TraceRequest] = []
    for index, row in enumerate(rows):
        keys: tuple[int, ...] = (_segment_key(_DOMAIN_UNIQUE, index),)
        if row.hash_ids is None:  # nothing shared: one segment of its own
            lengths, conversation = [row.input_length], f"mc-u{index}"
        else:
            ids = row.hash_ids
            keys = tuple(_segment_key(_DOMAIN_MOONCAKE, h) for h in ids)
            lengths = [block] * len(ids)
            lengths[-1] = row.input_length - block * (len(ids) - 1)
            conversation = f"mc-{ids[min(shared, len(ids) - 1)]}"
        out.append(
            TraceRequest(
                request_id=RequestId(f"mc-{index:06d}"),
                arrival_s=(row.timestamp - start_ms) / MS_PER_S / speedup,
                prompt_tokens=row.input_length,
                output_tokens=row.output_length,
                segment_keys=keys,
                segment_lengths=tuple(lengths),
                conversation_id=ConversationId(conversation),
                token_seed=seed,
                vocab_size=vocab_size,
            )
        )
    return out


# ---------------------------------------------------------------------------- sharing


@dataclass(frozen=True, slots=True)
class SharingModel:
    """Synthetic prefix sharing for traces that carry none (Azure, generated load).

    Requests are processed in arrival order with a generator seeded by ``seed``:

    * **Follow-up turns.** With probability ``followup_probability`` a request tries to
      continue an open session: one is chosen uniformly among the open sessions whose
      previous turn fits, i.e. ``previous prompt + previous output < this prompt``. The
      new prompt is the previous prompt, byte for byte, followed by fresh tokens (the
      answer and the new user message). If no session fits, a new session starts, so the
      achieved follow-up rate is at most ``followup_probability``.
    * **New sessions** start, with probability ``system_prompt_fraction``, with one of the
      shared system prompts (``system_prompt_tokens`` long, chosen by
      ``system_prompt_weights``, uniform when None) among those *strictly shorter* than the
      prompt; the rest of the prompt is fresh tokens. Follow-ups inherit it.
    * A session closes after ``session_idle_s`` without a turn (trace time, before speedup),
      and when more than ``max_open_sessions`` are open the least recently used closes.

    Every prompt keeps exactly the trace's length. ``SharingModel.none()`` shares nothing.
    """

    system_prompt_tokens: tuple[int, ...] = DEFAULT_SYSTEM_PROMPT_TOKENS
    system_prompt_weights: tuple[float, ...] | None = None
    system_prompt_fraction: float = DEFAULT_SYSTEM_PROMPT_FRACTION
    followup_probability: float = DEFAULT_FOLLOWUP_PROBABILITY
    session_idle_s: float = DEFAULT_SESSION_IDLE_S
    max_open_sessions: int = DEFAULT_MAX_OPEN_SESSIONS
    seed: int = 0

    def __post_init__(self) -> None:
        if any(n < 1 for n in self.system_prompt_tokens):
            raise ValueError("system prompt lengths must be >= 1 token")
        weights = self.system_prompt_weights
        if weights is not None and (
            len(weights) != len(self.system_prompt_tokens)
            or any(w < 0 for w in weights)
            or sum(weights) <= 0
        ):
            raise ValueError("system_prompt_weights: one non-negative weight per prompt")
        for name in ("system_prompt_fraction", "followup_probability"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1]")
        if self.session_idle_s <= 0 or self.max_open_sessions < 1:
            raise ValueError("session_idle_s must be > 0 and max_open_sessions >= 1")

    @classmethod
    def none(cls, seed: int = 0) -> SharingModel:
        return cls(
            system_prompt_tokens=(), system_prompt_fraction=0.0, followup_probability=0.0, seed=seed
        )


def _pick_system_prompt(
    rng: np.random.Generator,
    sharing: SharingModel,
    lengths: np.ndarray,
    weights: np.ndarray,
    prompt_tokens: int,
) -> int | None:
    """Index of the system prompt a new session starts with, or None."""
    fitting = np.flatnonzero(lengths < prompt_tokens)
    if not fitting.size or rng.random() >= sharing.system_prompt_fraction:
        return None
    p = weights[fitting]
    if p.sum() <= 0:
        return None
    return int(rng.choice(fitting, p=p / p.sum()))


def _apply_sharing(
    arrivals_s: np.ndarray,
    prompts: np.ndarray,
    outputs: np.ndarray,
    sharing: SharingModel,
    *,
    prefix: str,
    speedup: float,
    vocab_size: int,
) -> list[TraceRequest]:
    """Build requests from arrival times (trace seconds), prompt and output lengths."""
    rng = np.random.default_rng(sharing.seed)
    sys_lengths = np.asarray(sharing.system_prompt_tokens, dtype=np.int64)
    sys_weights = np.asarray(
        sharing.system_prompt_weights or [1.0] * len(sys_lengths), dtype=np.float64
    )
    capacity = sharing.max_open_sessions
    last_s = np.full(capacity, -np.inf)  # -inf marks a free slot
    needs = np.zeros(capacity, dtype=np.int64)  # a follow-up needs a prompt longer than this
    slot_segments: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((), ())] * capacity
    slot_session = [""] * capacity
    sessions = 0
    out: list[TraceRequest] = []
    for i in range(len(prompts)):
        t, prompt, output = float(arrivals_s[i]), int(prompts[i]), int(outputs[i])
        fresh = _segment_key(_DOMAIN_UNIQUE, i)
        slot = -1
        if rng.random() < sharing.followup_probability:
            fits = np.flatnonzero((last_s >= t - sharing.session_idle_s) & (needs < prompt))
            if fits.size:
                slot = int(fits[rng.integers(fits.size)])
        if slot >= 0:
            keys, lengths = slot_segments[slot]
            keys, lengths = (*keys, fresh), (*lengths, prompt - sum(lengths))
        else:
            keys, lengths = (fresh,), (prompt,)
            chosen = _pick_system_prompt(rng, sharing, sys_lengths, sys_weights, prompt)
            if chosen is not None:
                sys_len = int(sys_lengths[chosen])
                keys = (_segment_key(_DOMAIN_SYSTEM_PROMPT, chosen), fresh)
                lengths = (sys_len, prompt - sys_len)
            # A never-used slot (-inf), else the least recently used: an expired session
            # is older than every live one, so it is reused before any live one.
            slot = int(np.argmin(last_s))
            slot_session[slot] = f"{prefix}s{sessions:06d}"
            sessions += 1
        slot_segments[slot] = (keys, lengths)
        last_s[slot], needs[slot] = t, prompt + output
        out.append(
            TraceRequest(
                request_id=RequestId(f"{prefix}{i:06d}"),
                arrival_s=t / speedup,
                prompt_tokens=prompt,
                output_tokens=output,
                segment_keys=keys,
                segment_lengths=lengths,
                conversation_id=ConversationId(slot_session[slot]),
                token_seed=sharing.seed,
                vocab_size=vocab_size,
            )
        )
    return out


# ---------------------------------------------------------------------------- Azure


def load_azure(
    path: str | Path | None = None,
    *,
    limit: int | None = None,
    speedup: float = 1.0,
    sharing: SharingModel | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> list[TraceRequest]:
    """Read a CSV trace — Azure's, BurstGPT's or any with an arrival time and prompt and
    output lengths (:mod:`foretoken.sim.trace_csv`); sharing from ``sharing`` (default
    model). Rows without a first token (0 output tokens) are left out."""
    _check_speedup(speedup)
    source = Path(path) if path is not None else default_trace_path(AZURE_CONV_FILE)
    trace = read_csv_trace(source, limit)
    if trace.dropped:
        log.warning("%s: %d rows with no prompt or no output tokens left out", source,
                    trace.dropped)  # fmt: skip
    if not trace.prompts.size:
        return []
    return _apply_sharing(
        trace.arrivals_s,
        trace.prompts,
        trace.outputs,
        sharing if sharing is not None else SharingModel(),
        prefix="az-",
        speedup=speedup,
        vocab_size=vocab_size,
    )


# ---------------------------------------------------------------------------- synthetic


def gamma_arrivals(rate_rps: float, n: int, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Arrival times (s) of ``n`` requests, the first at 0, as ``vllm bench serve`` spaces
    them: gaps ~ Gamma(shape=burstiness, scale=1/(rate·burstiness)), so the mean rate is
    ``rate_rps`` and the gaps' coefficient of variation is ``1/sqrt(burstiness)``
    (1 = Poisson, < 1 burstier, > 1 more regular). ``rate_rps`` = inf sends all at once."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not rate_rps > 0:
        raise ValueError(f"rate_rps must be > 0, got {rate_rps}")
    if not burstiness > 0 or not math.isfinite(burstiness):
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness}")
    if n == 0:
        return np.zeros(0)
    if math.isinf(rate_rps):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate_rps * burstiness), size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Token counts ~ lognormal(median, sigma), rounded and clipped to [min, max];
    ``sigma`` = 0 gives ``median`` every time."""

    median: int
    sigma: float = 0.0
    min_tokens: int = 1
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.median < 1 or self.sigma < 0 or self.min_tokens < 1:
            raise ValueError("median and min_tokens must be >= 1 and sigma >= 0")
        if self.max_tokens is not None and self.max_tokens < self.min_tokens:
            raise ValueError("max_tokens must be >= min_tokens")

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        draws = self.median * np.exp(self.sigma * rng.standard_normal(n))
        upper = self.max_tokens if self.max_tokens is not None else np.iinfo(np.int64).max
        return np.clip(np.rint(draws), self.min_tokens, upper).astype(np.int64)


def synthetic_requests(
    n: int,
    *,
    rate_rps: float,
    prompt: LengthDistribution,
    output: LengthDistribution,
    burstiness: float = 1.0,
    sharing: SharingModel | None = None,
    seed: int = 0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> list[TraceRequest]:
    """Generated load: gamma arrivals, sampled lengths, sharing (none by default)."""
    rng = np.random.default_rng(seed)
    arrivals = gamma_arrivals(rate_rps, n, burstiness, seed)
    model = sharing if sharing is not None else SharingModel.none(seed)
    return _apply_sharing(
        arrivals,
        prompt.sample(n, rng),
        output.sample(n, rng),
        model,
        prefix="syn-",
        speedup=1.0,
        vocab_size=vocab_size,
    )
