-- Fraction of served requests predicted within 10 s (|predicted − actual| ≤ 10 s).
SELECT count(within_10s) AS graded, avg(within_10s::INTEGER) AS within_10s FROM graded
