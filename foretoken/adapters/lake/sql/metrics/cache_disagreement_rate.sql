-- How often the credited and the engine-reported cached tokens differ by ≥ one block.
SELECT known, disagreeing, disagreement_rate FROM cache_disagreement
