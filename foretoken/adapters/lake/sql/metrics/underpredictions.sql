-- Underpredictions over every bound: admitted, predicted ≤ B, actual > B; the rate is over
-- the served requests predicted within their bound.
SELECT
    coalesce(sum(promised), 0)::BIGINT AS promised,
    coalesce(sum(underpredictions), 0)::BIGINT AS underpredictions,
    sum(underpredictions) / nullif(sum(promised), 0) AS underprediction_rate,
    coalesce(sum(same_side), 0)::BIGINT AS same_side,
    sum(same_side) / nullif(
        sum(predicted_within_actual_within + predicted_within_actual_over
            + predicted_over_actual_within + predicted_over_actual_over),
        0
    ) AS same_side_fraction
FROM bounds
