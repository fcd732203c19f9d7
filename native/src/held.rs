//! Prompts sent to a worker that its engine still holds: per worker, how many held prompts
//! carry each own block hash (a count, so that two prompts sharing a prefix each take their
//! part out when they end).
//!
//! A chain of own hashes is prefix-closed — the hash of block `i` commits to blocks
//! `0..=i` — so the held prompts' hashes of a worker are a set closed under taking
//! prefixes, and the deepest block of a new chain they share is found by a binary search
//! over its positions. The Python reference is
//! `foretoken.core.routing.sent_prefixes._CountedChains`; both give the same depths
//! (`tests/unit/core/routing/test_sent_prefixes.py`).

use std::collections::HashMap;

use crate::flat::FlatMap;

/// Blocks between a prefetch and its use.
const AHEAD: usize = 8;

/// `f(map, h)` for each of `hashes` in order, each block's lines loaded `AHEAD` blocks
/// before: a prompt's blocks are spread over a table larger than the caches (as the
/// index's ingest does it).
fn each_prefetched(map: &mut FlatMap, hashes: &[u64], mut f: impl FnMut(&mut FlatMap, u64)) {
    for &h in &hashes[..hashes.len().min(AHEAD)] {
        map.prefetch_run(h);
    }
    for (i, &h) in hashes.iter().enumerate() {
        if let Some(&ahead) = hashes.get(i + AHEAD) {
            map.prefetch_run(ahead);
        }
        f(map, h);
    }
}

#[derive(Debug, Default)]
pub struct HeldChains {
    workers: HashMap<String, FlatMap>,
}

impl HeldChains {
    pub fn new() -> Self {
        Self::default()
    }

    /// One more prompt held on `worker`, with these own hashes.
    pub fn add(&mut self, worker: &str, hashes: &[u64]) {
        if hashes.is_empty() {
            return;
        }
        let map = match self.workers.get_mut(worker) {
            Some(map) => map,
            None => self.workers.entry(worker.to_owned()).or_default(),
        };
        each_prefetched(map, hashes, |map, h| {
            *map.get_or_insert(h, 0).1 += 1;
        });
    }

    /// A prompt added with these hashes is no longer held (hashes it never added are
    /// ignored).
    pub fn remove(&mut self, worker: &str, hashes: &[u64]) {
        let Some(map) = self.workers.get_mut(worker) else {
            return;
        };
        each_prefetched(map, hashes, |map, h| {
            map.update_or_remove(h, |c| c.saturating_sub(1));
        });
        if map.is_empty() {
            self.workers.remove(worker);
        }
    }

    pub fn forget_worker(&mut self, worker: &str) {
        self.workers.remove(worker);
    }

    pub fn holds(&self, worker: &str) -> bool {
        self.workers.contains_key(worker)
    }

    /// Hashes held on `worker` (distinct).
    pub fn len(&self, worker: &str) -> usize {
        self.workers.get(worker).map_or(0, FlatMap::len)
    }

    /// How many leading blocks of `chain` (at most `max_blocks`) a prompt held on `worker`
    /// shares.
    pub fn depth(&self, worker: &str, chain: &[u64], max_blocks: usize) -> usize {
        let top = chain.len().min(max_blocks);
        let Some(map) = self.workers.get(worker) else {
            return 0;
        };
        if top == 0 || !map.contains_key(chain[0]) {
            return 0;
        }
        let (mut low, mut high) = (1, top); // chain[..low] is held; find the largest such low
        while low < high {
            let mid = (low + high).div_ceil(2);
            if map.contains_key(chain[mid - 1]) {
                low = mid;
            } else {
                high = mid - 1;
            }
        }
        low
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefixes_are_counted() {
        let mut held = HeldChains::new();
        held.add("w", &[1, 2, 3, 4]);
        held.add("w", &[1, 2, 9]);
        assert_eq!(held.depth("w", &[1, 2, 3, 4, 5], 10), 4);
        assert_eq!(held.depth("w", &[1, 2, 3, 4, 5], 3), 3);
        assert_eq!(held.depth("w", &[1, 2, 9, 7], 10), 3);
        assert_eq!(held.depth("w", &[5, 2], 10), 0);
        assert_eq!(held.depth("v", &[1, 2], 10), 0);
        held.remove("w", &[1, 2, 3, 4]);
        assert_eq!(held.depth("w", &[1, 2, 3, 4, 5], 10), 2);
        held.remove("w", &[1, 2, 9]);
        assert!(!held.holds("w"));
        assert_eq!(held.depth("w", &[1], 10), 0);
    }

    #[test]
    fn key_zero_and_empty_chains() {
        let mut held = HeldChains::new();
        held.add("w", &[]);
        assert!(!held.holds("w"));
        held.add("w", &[0, 7]);
        assert_eq!(held.depth("w", &[0, 7, 8], 10), 2);
        assert_eq!(held.depth("w", &[], 10), 0);
        assert_eq!(held.len("w"), 2);
        held.forget_worker("w");
        assert_eq!(held.depth("w", &[0], 10), 0);
    }
}
