-- One row per request id — the latest written — with the grades of PRODUCT.md §4.
--
-- Dedupe: a request's re-deliveries keep its ts, hence its hour, and the writer never puts
-- a request id twice in one file; so only hours with more than one file can hold
-- duplicates, and only those rows go through the (costly) per-request-id dedupe, which
-- keeps the row of the file whose name sorts last (file names carry the write sequence).
-- A compacted hour has one file and passes straight through.
--
-- Derived columns. TTFT grades belong to served requests, and the lake holds actual_ttft_s
-- and error_s only on served rows (grading/lake.py enforces it), so these are NULL on any
-- other row without a test of the status:
--   abs_error_s = |error_s| (the attempt's error: grading/grades.py); within_1s /
--   within_10s = abs_error_s ≤ 1 / ≤ 10; predicted_within_bound = already_waited +
--   predicted ≤ B (the admission test; the actual TTFT counts the wait already);
--   actual_within_bound = actual ≤ B (B = max_queue_wait_s) — and false, not unknown, for
--   an admitted request that failed or was given up with no first token after already_waited
--   + e2e > B (its first token would have been later still: the worst misses);
--   underprediction = admitted ∧ predicted_within_bound ∧ ¬actual_within_bound, for the
--   requests the router promised: not an explore admission (a would-be rejection admitted
--   anyway; with predictor.admission_quantile its point prediction may well be ≤ B).
WITH multi_file_hours AS (
    SELECT hour FROM lake_files GROUP BY hour HAVING count(*) > 1
),
latest AS (
    SELECT * FROM graded_raw
    WHERE hour NOT IN (SELECT hour FROM multi_file_hours)
    UNION ALL
    (
        SELECT * FROM graded_raw
        WHERE hour IN (SELECT hour FROM multi_file_hours)
        QUALIFY row_number() OVER (PARTITION BY request_id ORDER BY filename DESC) = 1
    )
)
, bounded AS (
    SELECT
        *,
        coalesce(already_waited_s, 0) + predicted_ttft_s <= max_queue_wait_s
            AS predicted_within_bound,
        CASE
            WHEN actual_ttft_s IS NOT NULL THEN actual_ttft_s <= max_queue_wait_s
            WHEN admitted AND status IN ('error', 'cancelled')
                AND coalesce(already_waited_s, 0) + e2e_s > max_queue_wait_s THEN false
        END AS actual_within_bound
    FROM latest
)
SELECT
    * EXCLUDE (filename),
    filename AS source_file,
    abs(error_s) AS abs_error_s,
    abs(error_s) <= 1 AS within_1s,
    abs(error_s) <= 10 AS within_10s,
    admitted AND NOT coalesce(explore, false) AND predicted_within_bound
        AND NOT actual_within_bound AS underprediction
FROM bounded
