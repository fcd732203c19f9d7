"""The long-lived services' garbage collector, kept off the request path.

CPython's full collection walks every tracked object, and a service's heap is mostly what
its imports made (faust, aiokafka, numpy, statsmodels: ~150,000 functions, types, dicts and
tuples in the processor) plus its long-lived state. A full collection then took 80-150 ms
in the processor while it answered ``/v1/route`` at 500/s, and every request that arrived
meanwhile waited (``docs/BENCHMARKS.md``, "Collector pauses on the route path"). So, once a
service has started, everything alive is moved to the permanent generation
(:func:`gc.freeze`): later collections walk only what was made since. The records the route
service keeps by the hundred thousand (decisions with their candidates, outcomes, grades) are
msgspec structs the collector does not track (``gc=False``: frozen values that cannot hold a
cycle)."""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Freeze every object alive now (no collection first: that would be a full pass, the
    pause this avoids; what is garbage at this moment stays, once); returns how many."""
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("garbage collector: %d objects of the started service frozen", frozen)
    return frozen
