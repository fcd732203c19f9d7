-- Calibration of the grants' upper quantile: of the served requests whose grant carried a
-- predicted p90, the share whose measured TTFT was at or below it (0.9 when calibrated).
SELECT
    count(*) FILTER (status = 'served' AND predicted_ttft_p90_s IS NOT NULL
                     AND actual_ttft_s IS NOT NULL) AS graded_p90,
    -- the attempt's TTFT: the actual counts the time already waited, the p90 does not
    avg((actual_ttft_s - coalesce(already_waited_s, 0) <= predicted_ttft_p90_s)::INTEGER) FILTER (
        status = 'served' AND predicted_ttft_p90_s IS NOT NULL AND actual_ttft_s IS NOT NULL
    ) AS p90_coverage
FROM graded
