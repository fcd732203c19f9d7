-- accuracy_by(keys): the accuracy grades per group of the `graded` rows (PRODUCT.md §4),
-- grouped by the columns named in `keys`; the views accuracy_by_hour, by_worker,
-- by_model and by_class are this one aggregate with their own keys.
-- Over served requests with a prediction ("graded"): within-1 s / 10 s fractions and the
-- p50/p95/p99 of |error|. Over served requests with a bound B ("bounded"): how many were
-- predicted on the same side of B as they landed, and the underpredictions (admitted,
-- predicted ≤ B, actual > B).
CREATE MACRO accuracy_by(keys) AS TABLE
SELECT
    * EXCLUDE (abs_error_q, bounded, same_side, underpredictions),
    abs_error_q[1] AS abs_error_p50_s,
    abs_error_q[2] AS abs_error_p95_s,
    abs_error_q[3] AS abs_error_p99_s,
    bounded,
    same_side,
    underpredictions
FROM (
    SELECT
        COLUMNS(lambda c: list_contains(keys, c)),
        count(*) AS requests,
        count(*) FILTER (status = 'served') AS served,
        count(*) FILTER (status = 'rejected') AS rejected,
        count(abs_error_s) AS graded,
        avg(within_1s::INTEGER) AS within_1s,
        avg(within_10s::INTEGER) AS within_10s,
        quantile_cont(abs_error_s, [0.5, 0.95, 0.99]) AS abs_error_q,
        count(predicted_within_bound = actual_within_bound) AS bounded,
        count(*) FILTER (predicted_within_bound = actual_within_bound) AS same_side,
        count(*) FILTER (underprediction) AS underpredictions
    FROM graded
    GROUP BY ALL
)
ORDER BY ALL
