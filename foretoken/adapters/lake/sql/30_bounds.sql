-- Per bound value B (each max_queue_wait_s present), PRODUCT.md §4: what was admitted and
-- rejected, the underpredictions (admitted ∧ predicted ≤ B ∧ actual > B) and the
-- same-side-of-bound matrix over served requests with a prediction: predicted ≤ B or > B
-- against actual ≤ B or > B. "promised" = admitted requests predicted within B, whose side
-- of B is known, explore admissions left out (the denominator of the underprediction rate). Predicted and actual TTFT are compared with B
-- as they are (already_waited_s is not subtracted).
SELECT
    *,
    underpredictions / nullif(promised, 0) AS underprediction_rate,
    predicted_within_actual_within + predicted_over_actual_over AS same_side,
    (predicted_within_actual_within + predicted_over_actual_over) / nullif(
        predicted_within_actual_within + predicted_within_actual_over
        + predicted_over_actual_within + predicted_over_actual_over,
        0
    ) AS same_side_fraction
FROM (
    SELECT
        max_queue_wait_s AS bound_s,
        count(*) AS requests,
        count(*) FILTER (admitted) AS admitted,
        count(*) FILTER (NOT admitted) AS rejected,
        count(*) FILTER (admitted AND explore) AS explore_admitted,
        count(*) FILTER (status = 'served') AS served,
        count(*) FILTER (admitted AND NOT coalesce(explore, false) AND predicted_within_bound
                         AND actual_within_bound IS NOT NULL) AS promised,
        count(*) FILTER (underprediction) AS underpredictions,
        count(*) FILTER (predicted_within_bound AND actual_within_bound)
            AS predicted_within_actual_within,
        count(*) FILTER (predicted_within_bound AND NOT actual_within_bound)
            AS predicted_within_actual_over,
        count(*) FILTER (NOT predicted_within_bound AND actual_within_bound)
            AS predicted_over_actual_within,
        count(*) FILTER (NOT predicted_within_bound AND NOT actual_within_bound)
            AS predicted_over_actual_over
    FROM graded
    WHERE max_queue_wait_s IS NOT NULL
    GROUP BY max_queue_wait_s
)
ORDER BY bound_s
