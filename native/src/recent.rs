//! Recently removed blocks of one worker: engine hash → own hash, bounded.
//!
//! Engines publish a block's store in a slower tier and its removal from the GPU in either
//! order. When the last copy of a block leaves a worker, its mapping is kept here, so that a
//! later store naming it as parent chains from the right own hash, and a later store without
//! token ids (a move to another tier) files the right block.
//!
//! Layout: a 4-way set-associative cache. A set is one 64-byte cache line of four
//! `(engine, own)` pairs, newest first; an engine hash has one set (by its hash), an insert
//! puts it first in its set and the set's oldest pair falls out when the set is full. So an
//! operation costs one cache line, the memory is 16 bytes per slot, and a removed block is
//! remembered for about `capacity` later removals (exactly FIFO within its set). The
//! capacity (slots) grows with the worker's peak, never shrinks. `(0, 0)` marks an empty
//! slot: a pair (engine 0, own 0) is not remembered (an own hash is 0 with odds 2^-64).

use crate::table::mix;

pub const WAYS: usize = 4;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(align(64))]
pub struct Set(pub [[u64; 2]; WAYS]);

#[derive(Clone, Debug, Default)]
pub struct Recent {
    sets: Vec<Set>,
    len: usize,
}

const EMPTY: [u64; 2] = [0, 0];

impl Recent {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Slots (four per set).
    pub fn capacity(&self) -> usize {
        self.sets.len() * WAYS
    }

    pub fn clear(&mut self) {
        self.sets.iter_mut().for_each(|s| *s = Set::default());
        self.len = 0;
    }

    #[inline]
    fn set_of(&self, engine: u64) -> usize {
        ((u128::from(mix(engine)) * self.sets.len() as u128) >> 64) as usize
    }

    /// Starts loading the engine hash's set (see `FlatMap::prefetch`).
    #[inline]
    pub fn prefetch(&self, engine: u64) {
        if !self.sets.is_empty() {
            crate::prefetch::prefetch(&self.sets[self.set_of(engine)]);
        }
    }

    pub fn get(&self, engine: u64) -> Option<u64> {
        if self.sets.is_empty() {
            return None;
        }
        let set = &self.sets[self.set_of(engine)].0;
        set.iter()
            .find(|pair| pair[0] == engine && **pair != EMPTY)
            .map(|pair| pair[1])
    }

    /// Grows to at least `capacity` slots (re-filing what it holds, oldest first).
    fn reserve(&mut self, capacity: usize) {
        let sets = capacity.div_ceil(WAYS).max(1);
        if sets <= self.sets.len() {
            return;
        }
        let old = std::mem::replace(&mut self.sets, vec![Set::default(); sets]);
        self.len = 0;
        for set in old {
            for pair in set.0.iter().rev().filter(|p| **p != EMPTY) {
                self.file(pair[0], pair[1]);
            }
        }
    }

    /// Files a removed block as the newest of its set; `capacity` is the slots wanted (0:
    /// remember nothing). Growing leaves 1/8 headroom, so a peak that creeps up does not
    /// re-file the cache at every new block.
    pub fn insert(&mut self, engine: u64, own: u64, capacity: usize) {
        if capacity == 0 {
            return;
        }
        if self.sets.len() * WAYS < capacity {
            self.reserve(capacity + capacity / 8);
        }
        if [engine, own] != EMPTY {
            self.file(engine, own);
        }
    }

    fn file(&mut self, engine: u64, own: u64) {
        let at = self.set_of(engine);
        let set = &mut self.sets[at].0;
        // its old pair (if any), else the oldest slot, makes room; the rest shift back
        let stop = set
            .iter()
            .position(|p| p[0] == engine && *p != EMPTY)
            .or_else(|| set.iter().position(|p| *p == EMPTY));
        match stop {
            Some(i) => {
                if set[i] == EMPTY {
                    self.len += 1;
                }
                set.copy_within(0..i, 1);
            }
            None => set.copy_within(0..WAYS - 1, 1),
        }
        set[0] = [engine, own];
    }

    pub fn heap_bytes(&self) -> usize {
        self.sets.capacity() * std::mem::size_of::<Set>()
    }

    /// The sets, for snapshots.
    pub fn sets(&self) -> &[Set] {
        &self.sets
    }

    pub fn from_sets(sets: Vec<Set>) -> Self {
        let len = sets
            .iter()
            .map(|s| s.0.iter().filter(|p| **p != EMPTY).count())
            .sum();
        Self { sets, len }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_keeps_its_newest_four_and_reinsertion_refreshes() {
        let mut recent = Recent::default();
        recent.insert(1, 11, 4); // one set: every key shares it
        for e in 2..=5u64 {
            recent.insert(e, e + 10, 4);
        }
        assert_eq!(recent.len(), 4);
        assert_eq!(recent.get(1), None);
        assert_eq!(recent.get(2), Some(12));
        recent.insert(2, 22, 4); // newest again, with its new own hash
        recent.insert(6, 16, 4);
        assert_eq!(recent.get(2), Some(22));
        assert_eq!(recent.get(3), None);
        assert_eq!(recent.sets()[0].0, [[6, 16], [2, 22], [5, 15], [4, 14]]);
        let copy = Recent::from_sets(recent.sets().to_vec());
        assert_eq!((copy.len(), copy.get(5)), (4, Some(15)));
    }

    #[test]
    fn growing_keeps_the_entries_and_engine_zero_works() {
        let mut recent = Recent::default();
        recent.insert(0, 7, 4);
        assert_eq!(recent.get(0), Some(7));
        for e in 1..=1000u64 {
            recent.insert(e, e, 4096);
        }
        assert!(recent.capacity() >= 4096);
        let kept = (1..=1000u64).filter(|&e| recent.get(e) == Some(e)).count();
        assert!(kept > 990, "kept {kept}"); // a few sets of 4 overflow
        assert_eq!(recent.get(0), Some(7));
        recent.insert(0, 0, 4096); // the empty marker is not filed
        assert_eq!(recent.get(0), Some(7));
        recent.clear();
        assert_eq!((recent.len(), recent.get(5)), (0, None));
    }
}
