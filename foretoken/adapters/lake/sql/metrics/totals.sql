-- How many requests the lake holds (one per request id), by outcome.
SELECT
    count(*) AS requests,
    count(*) FILTER (status = 'served') AS served,
    count(*) FILTER (status = 'rejected') AS rejected,
    count(*) FILTER (status = 'error') AS errors,
    count(*) FILTER (status = 'cancelled') AS cancelled,
    count(*) FILTER (status = 'missing_outcome') AS missing_outcome,
    count(*) FILTER (admitted AND explore) AS explore_admitted,
    count(abs_error_s) AS graded,
    count(DISTINCT hour) AS hours,
    min(ts) AS first_ts,
    max(ts) AS last_ts
FROM graded
