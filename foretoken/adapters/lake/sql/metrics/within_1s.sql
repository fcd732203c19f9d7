-- Fraction of served requests predicted within 1 s (|predicted − actual| ≤ 1 s).
SELECT count(within_1s) AS graded, avg(within_1s::INTEGER) AS within_1s FROM graded
