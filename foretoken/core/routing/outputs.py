"""How long a request's answer will be, learned from completions (PRODUCT.md §3 "Output
lengths").

A queue model replays every outstanding request's decode: when it leaves, its KV blocks
and its seat free up for the prompts behind it. The router knows only the ``max_tokens``
its client sent — a cap, not a length: SDKs and apps send fixed caps (4096) or nothing,
and answers end at their own end of sequence, far below. Taken as the length, a cap makes
every running request hold its seat and blocks several times too long, and every wait
behind a full batch comes out several times too long.

:class:`OutputLengths` learns, per model, from each completion (its ``output_tokens``)
and the cap its request was sent with:

* for requests sent with a client's **setting** — a round cap such as 1024, 4096 or
  2000, or one above ``cold_output_tokens`` that ``SETTING_MIN`` of the model's last
  ``SETTING_WINDOW`` capped requests share — the answers do not scale with the cap (a
  client that sends 8192 does not get answers eight times as long as one that sends
  1024): ``cold_output_tokens`` moved toward the model's mean answer, then toward that
  setting's own, each against ``PRIOR_ANSWERS`` pseudo-answers and scaled by the
  model's ``censored_ratio`` (answers come back in the order they end: while long ones
  still stream, the answers learned are the short ones — the ratio is the model's
  Kaplan–Meier mean time from first token to end, the streams still running censored at
  their time since their first token, over the mean of the ended ones' times), within
  the cap (but where the other caps learned are all their answers' lengths, an exact
  client's, a setting not answered yet is too);
* for requests with **another cap** ``C`` (a per-request budget, or a length): the mean
  share of the cap used, ``q = L / C``, per power-of-two bucket of ``C`` and over all such
  caps (settings' shares kept out: a 8192 setting's 2% would make every budget's answer
  tiny); the expected length is ``C·q`` of the cap's bucket once it has ``BUCKET_MIN``
  samples, else of all caps once there are ``MIN_SAMPLES``, else ``C`` (a client whose
  cap is its answer's length shows q = 1, and its caps stay exact);
* for requests **without** one: the mean length of such answers (``MIN_SAMPLES``), else
  of every answer, else ``default_output_tokens`` (as before any was learned).

Means are running means over the last ~``HORIZON`` samples (weight ``1/min(n,
HORIZON)``), so a change of clients is followed. Failed and cancelled requests say
nothing of a length and are dropped. Outstanding requests were queued with the estimate of
their time; when a mean first becomes usable or moves by more than ``REESTIMATE_CHANGE``
``revision`` grows, and the route service gives every queued request its new estimate
(a burst sent before the first completion would otherwise hold its caps to the end);
so it does when a cap turns out to be a setting.

Beside each mean, the same samples' last ``HORIZON`` values are kept sorted: a request's
:class:`Tail` (``tail``) is that distribution scaled to its cap, from which the queue
models give a running answer what answers that ran as long went on for
(``core/queue/tails.py``). Every window that only ever saw answers run to their caps
gives no tail (exact caps stay exact). Means and windows go into the processor's snapshot.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec
import numpy as np

from foretoken.core.types import ModelName, RequestId

MIN_SAMPLES = 8
BUCKET_MIN = 4
HORIZON = 256
# A learned mean this far (relative) from the one the queue models last took: they take
# the new one (``revision``), outstanding requests included.
REESTIMATE_CHANGE = 0.1
# A cap this many of a model's last SETTING_WINDOW capped requests were sent with is a
# client's setting, not a length (``cold_output_tokens`` until answers are learned).
SETTING_MIN = 4
SETTING_WINDOW = 64
# A round cap — a power of two or a multiple of ROUND_STEP, at least ROUND_MIN — is a
# client's setting from its first request: SDKs' and apps' caps are round (1024, 4096,
# 8192, 2000), answers' lengths seldom are (0.0-0.6% of the traces' answers past 1,000).
ROUND_MIN = 1000
ROUND_STEP = 250
# Every learned share at least this close to 1: answers run to their caps (exact caps).
EXACT_SHARE = 1e-9
# A mean share of the caps (not settings) at least this: the model's clients send their
# answers' lengths, and a round cap of theirs is one too.
EXACT_SHARES = 0.99
# The cold length's weight in a setting's expected answer, in answers (_setting_expected).
PRIOR_ANSWERS = 8
# A model's answers still running are counted at most this often (seconds of outcome time:
# a Kaplan-Meier mean over a few hundred lengths costs ~0.1 ms).
CENSORED_EVERY_S = 0.1
# Learned answers are at most this long (route.max_output_tokens' default) and within
# their cap; one that streamed faster than this many tokens a second is not learned.
MAX_LEARNED_OUTPUT = 1 << 20
MAX_TOKENS_PER_S = 20_000
# Settings learned per model (their answers in tokens, least recently answered dropped),
# and the prefix of their keys in a snapshot ("s4096").
MAX_SETTINGS = 64
SETTING_KEY = "s"


@dataclass(slots=True)
class _Mean:
    n: int = 0
    mean: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.mean += (x - self.mean) / min(self.n, HORIZON)


class _Window:
    """The last ``HORIZON`` samples, also kept sorted: quantiles of those above a value."""

    __slots__ = ("order", "sorted")

    def __init__(self) -> None:
        self.order: deque[float] = deque()
        self.sorted: list[float] = []

    def add(self, x: float) -> None:
        self.order.append(x)
        if len(self.order) > HORIZON:
            del self.sorted[bisect_left(self.sorted, self.order.popleft())]
        insort(self.sorted, x)

    @classmethod
    def of(cls, samples: list[float]) -> _Window:
        window = cls()
        window.order.extend(samples)
        window.sorted = sorted(samples)
        return window


class Tail:
    """One request's answer length as learned (``core/queue/tails.py``): a quantile of the
    learned lengths above what it produced, minus that; shares of its ``cap`` when the
    window holds shares (``scale``), tokens otherwise. Past every sample: the learned mean
    again — at most what the cap (``limit``) leaves."""

    __slots__ = ("limit", "mean", "scale", "window")

    def __init__(self, window: _Window, cap: int, mean: float, limit: int = 0) -> None:
        self.window = window
        self.scale = cap or 1  # cap 0: the window holds tokens
        self.limit = cap or limit  # 0: no cap
        self.mean = mean  # in the window's unit

    def left(self, produced: int, u: float) -> int:
        # the u quantile of the window's samples above what it produced, minus that; inline:
        # called for every tailed decoder of every replay on the route path
        scale = self.scale
        done = produced / scale
        values = self.window.sorted
        n = len(values)
        i = bisect_right(values, done)
        if i < n:
            j = i + int(u * (n - i))
            tokens = (values[j if j < n else n - 1] - done) * scale
        else:
            tokens = self.mean * scale
        limit = self.limit
        if limit and tokens > limit - produced:
            tokens = limit - produced
        whole = math.ceil(tokens)
        return whole if whole > 1 else 1


class _Caps:
    """The caps of a model's last ``SETTING_WINDOW`` capped requests, counted."""

    __slots__ = ("counts", "order")

    def __init__(self) -> None:
        self.order: deque[int] = deque()
        self.counts: dict[int, int] = {}

    def add(self, cap: int) -> int:
        """Count ``cap``; how many of the window have it now."""
        self.order.append(cap)
        count = self.counts[cap] = self.counts.get(cap, 0) + 1
        if len(self.order) > SETTING_WINDOW:
            old = self.order.popleft()
            left = self.counts[old] - 1
            if left:
                self.counts[old] = left
            else:
                del self.counts[old]
        return count


def _km_mean(ended: Iterable[float], running: Iterable[float]) -> float:
    """The Kaplan–Meier mean of lengths of which ``ended`` are known and ``running`` are
    known to exceed the value given, restricted to the longest."""
    done = np.fromiter(ended, dtype=float)
    values = np.concatenate([done, np.fromiter(running, dtype=float)])
    if not len(values):
        return 0.0
    order = np.argsort(values, kind="stable")
    ends = np.zeros(len(values))
    ends[: len(done)] = 1.0
    xs, first = np.unique(values[order], return_index=True)
    at_risk = len(values) - first  # those at or above each distinct value
    alive_after = np.cumprod(1.0 - np.add.reduceat(ends[order], first) / at_risk)
    alive_before = np.concatenate([[1.0], alive_after[:-1]])
    return float(np.sum(alive_before * np.diff(xs, prepend=0.0)))


def _window_of(m: _Model, key: str) -> list[float]:
    """The window kept beside the mean named ``key``."""
    if key == "uncapped":
        window: _Window | None = m.uncapped_window
    elif key == "lengths":
        window = m.lengths_window
    elif key.startswith(SETTING_KEY) and key[1:].isdigit():
        found = m.settings.get(int(key[1:]))
        window = found[1] if found is not None else None
    elif key == "share":
        window = m.share_windows.get(0)
    else:
        window = m.share_windows.get(int(key)) if key.isdigit() else None
    return list(window.order) if window is not None else []


@dataclass(slots=True)
class _Model:
    # shares of the caps that are not settings, by floor(log2(cap)) and over all of them
    share_by_cap: dict[int, _Mean] = field(default_factory=dict)
    share: _Mean = field(default_factory=_Mean)
    uncapped: _Mean = field(default_factory=_Mean)
    lengths: _Mean = field(default_factory=_Mean)  # every answer, in tokens
    # the same samples' last HORIZON values, for the tails
    share_windows: dict[int, _Window] = field(default_factory=dict)  # 0: every cap
    uncapped_window: _Window = field(default_factory=_Window)
    lengths_window: _Window = field(default_factory=_Window)
    # answers to each setting (a cap: its mean and window, in tokens), least recent first
    settings: OrderedDict[int, tuple[_Mean, _Window]] = field(default_factory=OrderedDict)
    # the last HORIZON answers' times from their first token to their end, and the mean
    # such time counting the streams still running, over theirs alone: how short the
    # learned mean runs
    streamed: deque[float] = field(default_factory=lambda: deque(maxlen=HORIZON))
    censored_ratio: float = 1.0
    censored_at: float = -math.inf  # when it was last worked out


def is_round(cap: int) -> bool:
    """A cap a client set rather than an answer's length (``ROUND_MIN``)."""
    return cap >= ROUND_MIN and (cap % ROUND_STEP == 0 or cap & (cap - 1) == 0)


def _bucket(cap: int) -> int:
    return cap.bit_length()


class _MeanState(msgspec.Struct, array_like=True, frozen=True):
    model: str
    key: str  # "share", "uncapped", "lengths", or a cap bucket's number
    n: int
    mean: float
    # the same samples' window, oldest first (trailing: an older snapshot has none, and its
    # tails come back as answers do)
    window: list[float] = []


_SCALARS = ("share", "uncapped", "lengths")


class OutputLengths:
    """Expected output tokens per (model, cap sent), learned from completions."""

    def __init__(
        self, default_output_tokens: int, memory: int, learn: bool = True,
        cold_output_tokens: int = 0,
    ) -> None:  # fmt: skip
        if default_output_tokens < 1 or memory < 1 or cold_output_tokens < 0:
            raise ValueError("default_output_tokens and memory must be >= 1, "
                             "cold_output_tokens >= 0")  # fmt: skip
        self.default_output_tokens = default_output_tokens
        self.learn = learn
        self.cold_output_tokens = cold_output_tokens  # (not used while learn is off)
        self.memory = memory
        self.caps: dict[ModelName, _Caps] = {}  # the caps sent lately, per model
        self.models: dict[ModelName, _Model] = {}
        self.pending: OrderedDict[RequestId, tuple[ModelName, int | None]] = OrderedDict()
        # pending requests streaming: when their first token came
        self.running: dict[RequestId, float] = {}
        self.learned = 0
        self.revision = 0
        # means at the revision
        self._taken: dict[tuple[ModelName, int | str | None], float] = {}

    def expected(self, model: ModelName, cap: int | None) -> int:
        """The expected output tokens of a request for ``model`` sent with ``cap``."""
        m = self.models.get(model)
        if cap is None:
            if m is not None:
                for mean in (m.uncapped, m.lengths):
                    if mean.n >= MIN_SAMPLES:
                        return max(1, round(mean.mean))
            return self.default_output_tokens
        if self._setting(model, cap):
            return self._setting_expected(m, cap)
        bucket = m.share_by_cap.get(_bucket(cap)) if m is not None else None
        if bucket is not None and bucket.n >= BUCKET_MIN:
            share = bucket.mean
        elif m is not None and m.share.n >= MIN_SAMPLES:
            share = m.share.mean
        else:  # nothing learned: the cap
            return cap
        return max(1, min(cap, math.ceil(cap * share)))

    def _setting(self, model: ModelName, cap: int) -> bool:
        """Whether ``cap`` is taken as a client's setting: learning and the cold rule on, and
        a cap above the cold length or a round one (a smaller cap many requests repeat may
        be an exact client's common length: it keeps the shares)."""
        cold = self.cold_output_tokens
        if not (cold and self.learn) or not (cap > cold or is_round(cap)):
            return False
        return self.is_setting(model, cap)

    def _setting_expected(self, m: _Model | None, cap: int) -> int:
        """A setting's answers do not scale with it. ``cold_output_tokens``, moved toward
        the model's mean answer and then toward the setting's own as answers come, each
        weighed against ``PRIOR_ANSWERS`` pseudo-answers (the first answers of a burst are
        its shortest: taken alone they make the rest look short; the learned means are
        scaled by ``censored_ratio`` for the same reason); within the cap — but
        where every other cap learned is its answer's length (exact clients), a setting
        not answered yet is the cap."""
        expected = float(self.cold_output_tokens)
        if m is not None:
            own = m.settings.get(cap)
            if own is None and m.share.n >= MIN_SAMPLES and m.share.mean >= EXACT_SHARES:
                return cap
            for mean in (m.lengths, own[0] if own is not None else None):
                if mean is not None and mean.n:
                    n, learned = min(mean.n, HORIZON), mean.mean * m.censored_ratio
                    expected = (PRIOR_ANSWERS * expected + n * learned) / (PRIOR_ANSWERS + n)
        return max(1, min(cap, round(expected)))

    def is_setting(self, model: ModelName, cap: int) -> bool:
        """Whether ``cap`` is a client's setting: a round one (:func:`is_round`), one at
        least ``SETTING_MIN`` of the model's last ``SETTING_WINDOW`` capped requests were
        sent with exactly (a client whose caps are its answers' lengths seldom repeats one,
        nor sends round ones), or one whose answers were learned as a setting's (a
        restored snapshot has those, not the caps sent lately)."""
        if is_round(cap):
            return True
        caps = self.caps.get(model)
        if caps is not None and caps.counts.get(cap, 0) >= SETTING_MIN:
            return True
        m = self.models.get(model)
        return m is not None and cap in m.settings

    def tail(self, model: ModelName, cap: int | None) -> Tail | None:
        """The answer length of a request for ``model`` sent with ``cap`` as learned, for a
        decoder's residual length (None: nothing learned, or every answer ran to its cap —
        the cap is the length)."""
        m = self.models.get(model)
        if m is None:
            return None
        if cap is None:  # (a restored snapshot has the means, not the windows)
            window = m.uncapped_window
            usable = len(window.sorted) >= MIN_SAMPLES
            return Tail(window, 0, m.uncapped.mean) if usable else None
        if self._setting(model, cap):  # answers in tokens, within the cap
            own = m.settings.get(cap)
            if own is not None and len(own[1].sorted) >= BUCKET_MIN:
                return Tail(own[1], 0, own[0].mean, limit=cap)
            if m.share.n >= MIN_SAMPLES and m.share.mean >= EXACT_SHARES:
                return None  # exact clients: the cap is the length
            if len(m.lengths_window.sorted) >= MIN_SAMPLES:
                return Tail(m.lengths_window, 0, m.lengths.mean, limit=cap)
            return None
        key = _bucket(cap)
        bucket, found = m.share_by_cap.get(key), m.share_windows.get(key)
        if bucket is not None and found is not None and len(found.sorted) >= BUCKET_MIN:
            mean = bucket.mean
        else:
            found, mean = m.share_windows.get(0), m.share.mean
            if found is None or len(found.sorted) < MIN_SAMPLES:
                return None
        if found.sorted[0] >= 1.0 - EXACT_SHARE:
            return None
        return Tail(found, cap, mean)

    def tail_for(self, rid: RequestId) -> Tail | None:
        """:meth:`tail` of an outstanding request (None: not one we know, or no tail)."""
        known = self.pending.get(rid)
        return None if known is None else self.tail(*known)

    def expected_for(self, rid: RequestId) -> int | None:
        """The expected output of an outstanding request (None: not one we know)."""
        known = self.pending.get(rid)
        return None if known is None else self.expected(*known)

    def describe(self) -> dict[str, object]:
        """What was learned, per model (``/v1/fits`` ``output_lengths``)."""
        out: dict[str, object] = {}
        for model, m in sorted(self.models.items()):
            caps = {f"{1 << (b - 1)}-{(1 << b) - 1}": {"share": round(v.mean, 4), "samples": v.n}
                    for b, v in sorted(m.share_by_cap.items())}  # fmt: skip
            out[model] = {
                "share_of_cap": round(m.share.mean, 4), "capped_samples": m.share.n,
                "by_cap": caps, "mean_without_cap": round(m.uncapped.mean, 1),
                "uncapped_samples": m.uncapped.n, "mean_answer": round(m.lengths.mean, 1),
                "expected_without_cap": self.expected(model, None),
                "settings": {str(cap): {"mean": round(mean.mean, 1), "samples": mean.n}
                             for cap, (mean, _) in sorted(m.settings.items())},
            }  # fmt: skip
        return out

    def state(self) -> bytes:
        """The learned means and their windows (a processor's snapshot, beside its fits),
        as msgpack."""
        rows = [_MeanState(model, key, mean.n, mean.mean, _window_of(m, key))
                for model, m in self.models.items()
                for key, mean in [*((k, getattr(m, k)) for k in _SCALARS),
                                  *((str(b), v) for b, v in m.share_by_cap.items()),
                                  *((f"{SETTING_KEY}{cap}", v) for cap, (v, _) in
                                    m.settings.items())]]  # fmt: skip
        return msgspec.msgpack.encode(rows)

    def load_state(self, data: bytes) -> None:
        """Take a snapshot's means and windows (raises ``ValueError`` on a malformed one)."""
        try:
            rows = msgspec.msgpack.decode(data, type=list[_MeanState])
        except msgspec.DecodeError as exc:
            raise ValueError(f"output lengths snapshot: {exc}") from exc
        models: dict[ModelName, _Model] = {}
        for row in rows:
            if row.n < 0 or not math.isfinite(row.mean) or row.mean < 0:
                raise ValueError(f"output lengths snapshot: a bad mean for {row.model}")
            setting = row.key.startswith(SETTING_KEY) and row.key[1:].isdigit()
            in_tokens = setting or row.key in ("uncapped", "lengths")
            if len(row.window) > HORIZON or not all(
                math.isfinite(x) and x >= 0 and (in_tokens or x <= 1) for x in row.window
            ):  # fmt: skip
                raise ValueError(f"output lengths snapshot: a bad window for {row.model}")
            m = models.setdefault(ModelName(row.model), _Model())
            mean = _Mean(row.n, row.mean)
            window = _Window.of(row.window) if row.window else None
            if row.key in _SCALARS:
                setattr(m, row.key, mean)
            elif row.key.isdigit():
                m.share_by_cap[int(row.key)] = mean
            elif setting and len(m.settings) < MAX_SETTINGS:
                m.settings[int(row.key[1:])] = (mean, window or _Window())
            elif not setting:
                raise ValueError(f"output lengths snapshot: unknown key {row.key!r}")
            if window is None or setting:
                continue
            if row.key in ("uncapped", "lengths"):
                setattr(m, f"{row.key}_window", window)
            else:  # "share" or a cap bucket
                m.share_windows[0 if row.key == "share" else int(row.key)] = window
        self.models = models
        self.revision += 1

    def sent(self, rid: RequestId, model: ModelName, cap: int | None) -> None:
        """A request went out with this cap (a decision or another router's grant)."""
        if rid not in self.pending:
            self.pending[rid] = (model, cap)
            if len(self.pending) > self.memory:
                self.running.pop(self.pending.popitem(last=False)[0], None)
            if cap is not None and self.cold_output_tokens and self.learn:
                caps = self.caps.get(model)
                if caps is None:
                    caps = self.caps[model] = _Caps()
                if (caps.add(cap) == SETTING_MIN and cap > self.cold_output_tokens
                        and not is_round(cap)):  # fmt: skip
                    self.revision += 1  # its requests already queued: the cold estimate

    def forget(self, rid: RequestId) -> None:
        self.pending.pop(rid, None)
        self.running.pop(rid, None)

    def started(self, rid: RequestId, at_s: float) -> None:
        """An outstanding request's first token came at ``at_s``."""
        if rid in self.pending and self.learn:
            self.running[rid] = at_s
            if len(self.running) > self.memory:
                self.running.pop(next(iter(self.running)))

    def completed(
        self, rid: RequestId, output_tokens: int, at_s: float | None = None,
        streamed_s: float | None = None,
    ) -> None:  # fmt: skip
        """A request's answer ended after ``output_tokens`` (at ``at_s``, ``streamed_s``
        after its first token: the answers still streaming are then censored at their time
        since theirs)."""
        known = self.pending.pop(rid, None)
        self.running.pop(rid, None)
        if known is None or output_tokens < 1 or not self.learn:
            return
        model, cap = known
        # a count no engine could have made is not learned (an outcome from a stranger or
        # a miscount: 2^40 tokens in 20 ms priced every later request at years)
        output_tokens = min(output_tokens, cap or MAX_LEARNED_OUTPUT, MAX_LEARNED_OUTPUT)
        if streamed_s is not None and output_tokens > MAX_TOKENS_PER_S * max(streamed_s, 0) + 256:
            return  # (256: an engine may send a short answer's tokens in one chunk)
        m = self.models.setdefault(model, _Model())
        m.lengths.add(output_tokens)
        m.lengths_window.add(output_tokens)
        if streamed_s is not None and streamed_s >= 0 and math.isfinite(streamed_s):
            m.streamed.append(streamed_s)
        self.learned += 1
        if (at_s is not None and len(m.streamed) >= MIN_SAMPLES
                and not at_s - CENSORED_EVERY_S < m.censored_at <= at_s):  # fmt: skip
            m.censored_ratio, m.censored_at = self._censored_ratio(model, m, at_s), at_s
        if cap is None:
            m.uncapped.add(output_tokens)
            m.uncapped_window.add(output_tokens)
            self._moved(model, None, m.uncapped, MIN_SAMPLES)
            return
        if self._setting(model, cap):  # its answers, in tokens, and the fallback's mean
            self._moved(model, "lengths", m.lengths, MIN_SAMPLES)
            own = m.settings.pop(cap, None) or (_Mean(), _Window())
            m.settings[cap] = own  # the most recently answered last
            if len(m.settings) > MAX_SETTINGS:
                m.settings.popitem(last=False)
            own[0].add(output_tokens)
            own[1].add(output_tokens)
            self._moved(model, f"{SETTING_KEY}{cap}", own[0], BUCKET_MIN)
            return
        share = min(output_tokens / cap, 1.0)
        m.share.add(share)
        bucket = m.share_by_cap.setdefault(_bucket(cap), _Mean())
        bucket.add(share)
        for key in (0, _bucket(cap)):
            m.share_windows.setdefault(key, _Window()).add(share)
        self._moved(model, 0, m.share, MIN_SAMPLES)
        self._moved(model, _bucket(cap), bucket, BUCKET_MIN)

    def _censored_ratio(self, model: ModelName, m: _Model, now_s: float) -> float:
        """The model's mean time streamed counting the answers still streaming as censored
        at their time since the first token (Kaplan–Meier, up to the longest), over the
        mean of the answers' times alone: answers come back in the order they end, so while
        long ones still stream the answers learned are the short ones. In time, not tokens:
        what a stream has produced so far is not known, and a worker's pace moves with its
        batch (a long prefill beside it slows every step)."""
        pending = self.pending
        streaming = [now_s - t for rid, t in self.running.items()
                     if now_s > t and pending.get(rid, (None,))[0] == model]  # fmt: skip
        ended = m.streamed
        naive = sum(ended) / len(ended)
        if not streaming or naive <= 0:
            return 1.0
        return max(1.0, _km_mean(ended, streaming) / naive)

    def _moved(self, model: ModelName, key: int | str | None, mean: _Mean, usable: int) -> None:
        if mean.n < usable:
            return
        taken = self._taken.get((model, key))
        if taken is None or abs(mean.mean - taken) > REESTIMATE_CHANGE * taken:
            self._taken[(model, key)] = mean.mean
            self.revision += 1
