-- Tails of |predicted − actual| over served requests (averages are not grades).
SELECT
    q[1] AS abs_error_p50_s,
    q[2] AS abs_error_p95_s,
    q[3] AS abs_error_p99_s,
    max_s AS abs_error_max_s
FROM (
    SELECT quantile_cont(abs_error_s, [0.5, 0.95, 0.99]) AS q, max(abs_error_s) AS max_s
    FROM graded
)
