"""A quick summary of graded records in memory (the demo's table; the lake and its SQL views
are the analysts' tool). Definitions as PRODUCT.md §4."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from foretoken.core.types import GradedRequest


def summarize(graded: Sequence[GradedRequest]) -> dict[str, Any]:
    served = [g for g in graded if g.status == "served"]
    errors = np.array([g.error_s for g in served if g.error_s is not None], dtype=float)
    known = [g for g in served if g.cache_disagreement is not None]
    bounded = [g for g in served if g.max_queue_wait_s is not None and g.actual_ttft_s is not None]
    under = sum(
        1 for g in bounded
        if g.predicted_ttft_s is not None and g.max_queue_wait_s is not None
        and g.actual_ttft_s is not None
        and g.already_waited_s + g.predicted_ttft_s <= g.max_queue_wait_s < g.actual_ttft_s
    )  # fmt: skip
    abs_err = np.abs(errors)
    return {
        "graded": len(graded),
        "served": len(served),
        "rejected": sum(1 for g in graded if g.status == "rejected"),
        "predicted": int(errors.size),
        "within_1s": float(np.mean(abs_err <= 1.0)) if errors.size else None,
        "within_10s": float(np.mean(abs_err <= 10.0)) if errors.size else None,
        "abs_error_p50_s": float(np.percentile(abs_err, 50)) if errors.size else float("nan"),
        "abs_error_p95_s": float(np.percentile(abs_err, 95)) if errors.size else float("nan"),
        "abs_error_p99_s": float(np.percentile(abs_err, 99)) if errors.size else float("nan"),
        "disagreement": (sum(1 for g in known if g.cache_disagreement) / len(known))
        if known else None,
        "underpredicted": under,
    }  # fmt: skip
