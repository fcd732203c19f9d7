-- The visible part files of the lake (one row per file) and the hour directory each is in.
-- Hidden ".part-….parquet.tmp" files of writes in progress never match the glob.
SELECT
    file AS filename,
    regexp_extract(file, 'hour=([^/\\]+)[/\\][^/\\]+$', 1) AS hour
FROM glob(lake_glob())
