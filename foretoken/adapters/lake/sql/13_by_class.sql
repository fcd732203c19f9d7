-- Accuracy per workload class (the grades of accuracy_by, 09_accuracy_by.sql).
SELECT * FROM accuracy_by(['workload_class'])
