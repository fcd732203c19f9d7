"""Workers that stopped answering, kept out of the candidates for a while (pure).

A dead engine looks idle to every queue model: its requests end at once, so its queue stays
empty and its predicted TTFT is the fleet's lowest — it attracts the work it cannot do. The
router knows first (the connection is refused, or nothing comes back before
``router.engine_timeout_s``) and says so in the request's completion outcome (its ``error``
starts with :data:`ENGINE_UNREACHABLE`), which reaches every route service through
``outcomes``. Each such outcome takes the worker out of the candidates for ``cooldown_s``,
doubled at every new failure up to ``max_cooldown_s``; a first token from it (a probe after
the cooldown, or a request already there) puts it back at once. When every worker of a model
is out, all are candidates again (an outage is not made worse by refusing everything).
Errors the engine answered (a 400 for a bad request, a broken stream) are not this: a worker
that answers is alive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from foretoken.core.types import RequestOutcome, WorkerId

# The start of a completion outcome's ``error`` when the engine did not answer at all.
ENGINE_UNREACHABLE: Final = "engine unreachable"


@dataclass(frozen=True, slots=True)
class HealthConfig:
    cooldown_s: float = 10.0
    max_cooldown_s: float = 120.0

    def __post_init__(self) -> None:
        if not 0 < self.cooldown_s <= self.max_cooldown_s:
            raise ValueError("need 0 < cooldown_s <= max_cooldown_s")


@dataclass
class WorkerHealth:
    config: HealthConfig = field(default_factory=HealthConfig)
    # worker → (out until, the cooldown its next failure gets)
    out: dict[WorkerId, tuple[float, float]] = field(default_factory=dict)
    trips: int = 0

    def observe(self, outcome: RequestOutcome, now_s: float) -> None:
        wid = outcome.worker_id
        if outcome.actual_ttft_s is not None and outcome.status == "ok":
            self.out.pop(wid, None)  # it answers
        elif (outcome.kind == "completion" and outcome.error is not None
              and outcome.error.startswith(ENGINE_UNREACHABLE)):  # fmt: skip
            _, cooldown = self.out.get(wid, (0.0, self.config.cooldown_s))
            self.out[wid] = (now_s + cooldown, min(2 * cooldown, self.config.max_cooldown_s))
            self.trips += 1

    def is_out(self, wid: WorkerId, now_s: float) -> bool:
        entry = self.out.get(wid)
        return entry is not None and now_s < entry[0]

    def stats(self, now_s: float) -> dict[str, object]:
        return {"out": sorted(w for w in self.out if self.is_out(w, now_s)), "trips": self.trips}
