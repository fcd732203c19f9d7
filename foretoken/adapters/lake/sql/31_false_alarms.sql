-- False alarms, the direct estimate (PRODUCT.md §4). A false alarm is a rejected request
-- that would have been served within its bound B; a rejected request never gets a TTFT, so
-- a small random fraction of would-be rejections is admitted anyway, flagged explore.
-- Per B: the fraction of explore admissions within B (an error or a cancellation counts as
-- not within; one whose outcome never came is left out) with its 95% Wilson score
-- interval, and the estimated false alarms among the rejected = rejected × that fraction
-- (interval scaled alike). Only the predictor's own would-be rejections are ever explored
-- (reasons predicted_ttft_exceeds_bound, prefill_exceeds_bound, overloaded; not the
-- router's fallback): the others — no worker can hold the prompt, no worker serves the
-- model, the latency controls shed the class — are counted apart (rejected_not_explored),
-- never scaled by a rate they were not sampled for. A record from before reject_reason was
-- kept counts as explorable. The model-based estimate (from served requests) is
-- grading/false_alarms.py.
WITH per_bound AS (
    SELECT
        max_queue_wait_s AS bound_s,
        count(*) FILTER (NOT admitted AND NOT fallback AND coalesce(reject_reason,
            'predicted_ttft_exceeds_bound') IN ('predicted_ttft_exceeds_bound',
            'prefill_exceeds_bound', 'overloaded')) AS rejected,
        count(*) FILTER (NOT admitted) AS rejected_all,
        count(*) FILTER (admitted AND explore AND status <> 'missing_outcome')
            AS explore_admitted,
        count(*) FILTER (admitted AND explore AND actual_within_bound) AS explore_within
    FROM graded
    WHERE max_queue_wait_s IS NOT NULL
    GROUP BY max_queue_wait_s
),
fraction AS (
    SELECT
        *,
        1.959963984540054 AS z,  -- the standard normal's 97.5% point: a 95% interval
        explore_admitted AS n,
        explore_within / nullif(explore_admitted, 0) AS p
    FROM per_bound
),
wilson AS (
    SELECT
        *,
        (p + z * z / (2 * n)) / (1 + z * z / n) AS center,
        z / (1 + z * z / n) * sqrt(p * (1 - p) / n + z * z / (4 * n * n)) AS half_width
    FROM fraction
),
bounded AS (  -- greatest/least skip NULLs: no explore admission leaves the interval NULL
    SELECT
        *,
        CASE WHEN n > 0 THEN greatest(center - half_width, 0.0) END AS lo,
        CASE WHEN n > 0 THEN least(center + half_width, 1.0) END AS hi
    FROM wilson
)
SELECT
    bound_s,
    rejected,
    rejected_all - rejected AS rejected_not_explored,
    explore_admitted,
    explore_within,
    p AS within_fraction,
    lo AS within_fraction_lo,
    hi AS within_fraction_hi,
    rejected * p AS estimated_false_alarms,
    rejected * lo AS estimated_false_alarms_lo,
    rejected * hi AS estimated_false_alarms_hi
FROM bounded
ORDER BY bound_s
