"""How much slower than its prior a cold worker has already shown itself to be.

A worker without a fit of its own is priced by a prior: its peers' pooled curve, else the
default (:mod:`foretoken.core.cost.registry`). When that worker runs on slower hardware than
the prior says, nothing corrects the prior until its first token comes back — and until then
the queue model believes its requests done at their predicted times, sees an idle worker,
and sends it more. Measured on a fleet with one engine of the same model 10× slower than its
peers (`foretoken bench predict --explain`, Mooncake trace at 1.0×): the four requests sent
there 0.7 s after the start were predicted at 0.36–1.28 s on the peers' curve, and took
11.7–40.9 s.

Yet a request still without its first token carries information: one predicted at ``p``
and sent ``e`` seconds ago shows the worker at least ``e / p`` times slower than priced.
:meth:`Overdue.factor` is the largest such ratio over the worker's requests decided on a
prior and still waiting, times ``margin`` (the request is still running: the truth lies
beyond the bound), at most ``max_scale``; 1 when none is overdue. The prediction path
prices such a worker with its prior curve times that factor — in the queue walk too, so the
work still ahead of a new request is seen. A worker's own fit ends it: only requests
decided on a prior are recorded, only once their grant comes back on ``grants`` (the router
sent them: a caller that only asks for a prediction, and never sends, proves nothing), and a
first token (or a failure, a completion, an expiry) takes a request out. Everything here is
what the route service itself decided and observed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from foretoken.core.types import RequestId, WorkerId


@dataclass(frozen=True, slots=True)
class OverdueConfig:
    floor_s: float = 0.05  # a prediction below this counts as this (no huge ratios)
    margin: float = 1.5
    max_scale: float = 16.0
    memory: int = 100_000  # requests remembered at most (the oldest go first)
    max_age_s: float = 600.0  # a request waiting longer is forgotten (a lost outcome)

    def __post_init__(self) -> None:
        if not (self.floor_s > 0 and self.margin >= 1 and self.max_scale >= 1):
            raise ValueError("need floor_s > 0, margin >= 1 and max_scale >= 1")
        if self.memory < 1 or not self.max_age_s > 0:
            raise ValueError("need memory >= 1 and max_age_s > 0")


class Overdue:
    """Per worker, its requests decided on a prior and still without a first token."""

    def __init__(self, config: OverdueConfig = OverdueConfig()) -> None:
        self.config = config
        self._where: OrderedDict[RequestId, WorkerId] = OrderedDict()
        # per worker: request -> (decided, predicted, its grant came back)
        self._pending: dict[WorkerId, dict[RequestId, tuple[float, float, bool]]] = {}

    def sent(self, rid: RequestId, wid: WorkerId, decided_s: float, predicted_s: float) -> None:
        """``rid`` was sent to ``wid`` at ``decided_s``, predicted at ``predicted_s`` on the
        worker's prior curve."""
        if rid in self._where:
            self.done(rid)
        self._where[rid] = wid
        self._pending.setdefault(wid, {})[rid] = (decided_s, max(predicted_s, 0.0), False)
        while len(self._where) > self.config.memory:
            self.done(next(iter(self._where)))

    def confirm(self, rid: RequestId, wid: WorkerId | None) -> None:
        """Its grant came back naming ``wid``: it was sent there (another worker: it went
        elsewhere, and is no evidence about this one)."""
        where = self._where.get(rid)
        if where is None:
            return
        if where != wid:
            self.done(rid)
            return
        decided_s, predicted_s, _ = self._pending[where][rid]
        self._pending[where][rid] = (decided_s, predicted_s, True)

    def done(self, rid: RequestId) -> None:
        """Its first token came (or it failed, or completed, or went elsewhere)."""
        wid = self._where.pop(rid, None)
        if wid is not None:
            pending = self._pending.get(wid)
            if pending is not None:
                pending.pop(rid, None)
                if not pending:
                    del self._pending[wid]

    def forget_worker(self, wid: WorkerId) -> None:
        for rid in list(self._pending.get(wid, ())):
            self.done(rid)

    def factor(self, wid: WorkerId, now_s: float) -> float:
        """The scale on the worker's prior (module doc): 1 when nothing is overdue."""
        pending = self._pending.get(wid)
        if not pending:
            return 1.0
        cfg = self.config
        worst, stale = 1.0, []
        for rid, (decided_s, predicted_s, confirmed) in pending.items():
            waited = now_s - decided_s
            if waited > cfg.max_age_s:
                stale.append(rid)
            elif confirmed:
                worst = max(worst, waited / max(predicted_s, cfg.floor_s))
        for rid in stale:
            self.done(rid)
        return 1.0 if worst <= 1.0 else min(worst * cfg.margin, cfg.max_scale)

    def __len__(self) -> int:
        return len(self._where)
