-- Every row of every part file, typed as the Graded record (graded_stub: the columns exist,
-- typed, even before the first file is written or when an older file lacks a newer field),
-- plus the hour (from the path) and the file it came from. A re-delivered request id may
-- appear here more than once: read `graded`, which keeps one row per request id.
-- The hour is the part file's own directory, read as lake_files reads it: no hive
-- partitioning, which would also take a `name=value` directory above the lake (a lake under
-- `runs/model=x/`) as a column and overwrite that column of every row.
SELECT * REPLACE (regexp_extract(filename, 'hour=([^/\\]+)[/\\][^/\\]+$', 1) AS hour)
FROM (
    SELECT COLUMNS(lambda c: c <> 'empty')  -- read_parquet's placeholder column for no files
    FROM (
        SELECT * FROM graded_stub
        UNION ALL BY NAME
        SELECT *
        FROM read_parquet(
            lake_glob(),
            hive_partitioning = false,
            union_by_name = true,
            filename = true,
            allow_empty = true
        )
    )
)
-- A Parquet file dropped into the lake by something else has no request ids: not requests.
WHERE request_id IS NOT NULL
