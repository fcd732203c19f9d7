-- Where the cache credit came from (issue 9), over served requests: "events" (the engines'
-- own KV events), "approximate" (engines that publish none: credited from the prompts
-- foretoken routed there, aged by a TTL and an estimated capacity) or "sent" (a prompt
-- foretoken sent there and the engine still held, its KV events not in yet). Rows written before
-- the column existed count as "events". Engines that report no cached tokens leave their
-- reuse unknown (NULL, never 0): reuse_known / reuse_unknown count both kinds, and the
-- disagreement (PRODUCT.md §4) is computed only where both sides are known.
SELECT
    coalesce(cache_source, 'events') AS cache_source,
    count(*) AS served,
    count(engine_cached_tokens) AS reuse_known,
    count(*) - count(engine_cached_tokens) AS reuse_unknown,
    count(*) FILTER (credited_cached_tokens > 0) AS credited,
    count(*) FILTER (cache_disagreement) AS disagreeing,
    avg(cache_disagreement::INTEGER) AS disagreement_rate,
    count(within_1s) AS graded,
    avg(within_1s::INTEGER) AS within_1s,
    quantile_cont(abs_error_s, 0.5) AS abs_error_p50_s,
    quantile_cont(abs_error_s, 0.95) AS abs_error_p95_s
FROM graded
WHERE status = 'served'
GROUP BY ALL
ORDER BY cache_source
