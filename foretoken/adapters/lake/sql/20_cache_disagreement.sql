-- Cache disagreement (PRODUCT.md §4), over served requests where both sides are known: the
-- cached tokens foretoken credited and those the engine reported differ by at least one
-- block. Within 1 s is reported separately for agreeing and disagreeing requests (the
-- reference deployment saw 95.8% vs 58.6%, with 4% disagreeing).
SELECT
    count(*) AS known,
    count(*) FILTER (cache_disagreement) AS disagreeing,
    avg(cache_disagreement::INTEGER) AS disagreement_rate,
    count(within_1s) FILTER (NOT cache_disagreement) AS graded_agreeing,
    avg(within_1s::INTEGER) FILTER (NOT cache_disagreement) AS within_1s_agreeing,
    count(within_1s) FILTER (cache_disagreement) AS graded_disagreeing,
    avg(within_1s::INTEGER) FILTER (cache_disagreement) AS within_1s_disagreeing
FROM graded
WHERE status = 'served' AND cache_disagreement IS NOT NULL
