-- Accuracy per worker (the grades of accuracy_by; a rejected request has no worker: the
-- NULL row).
SELECT * FROM accuracy_by(['model', 'worker_id'])
