//! Recently removed blocks of one worker: engine hash → own hash, bounded, oldest out first.
//!
//! Engines publish a block's store in a slower tier and its removal from the GPU in either
//! order. When the last copy of a block leaves a worker, its mapping is kept here, so that a
//! later store naming it as parent chains from the right own hash, and a later store without
//! token ids (a move to another tier) files the right block.
//!
//! Layout: a ring of `(engine, own)` in removal order, and a hash table of ring positions
//! (as wrapping u32 sequence numbers), about 24 bytes per entry. Re-inserting an engine hash
//! moves it to the newest position; the old ring slot is left behind as a stale slot that
//! the table no longer points to, and is dropped when it reaches the front. So an entry
//! stays for the next `capacity` insertions (removals of blocks), whatever they are.

use std::collections::VecDeque;

use hashbrown::HashTable;

use crate::table::key_hash;

#[derive(Clone, Debug, Default)]
pub struct Recent {
    ring: VecDeque<(u64, u64)>,
    /// Sequence number of `ring[0]`.
    head: u64,
    table: HashTable<u32>,
}

impl Recent {
    /// Entries the table points to (stale ring slots excluded).
    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    pub fn clear(&mut self) {
        *self = Self::default();
    }

    fn position(&self, seq: u32) -> usize {
        seq.wrapping_sub(self.head as u32) as usize
    }

    pub fn get(&self, engine: u64) -> Option<u64> {
        let ring = &self.ring;
        let head = self.head as u32;
        self.table
            .find(key_hash(engine), |&seq| {
                ring[seq.wrapping_sub(head) as usize].0 == engine
            })
            .map(|&seq| self.ring[self.position(seq)].1)
    }

    /// Files a removed block as the newest entry, then drops the oldest beyond `capacity`.
    pub fn insert(&mut self, engine: u64, own: u64, capacity: usize) {
        let hash = key_hash(engine);
        let head = self.head as u32;
        let ring = &self.ring;
        if let Ok(entry) = self.table.find_entry(hash, |&seq| {
            ring[seq.wrapping_sub(head) as usize].0 == engine
        }) {
            entry.remove();
        }
        let seq = (self.head + self.ring.len() as u64) as u32;
        self.ring.push_back((engine, own));
        let ring = &self.ring;
        self.table.insert_unique(hash, seq, |&s| {
            key_hash(ring[s.wrapping_sub(head) as usize].0)
        });
        while self.ring.len() > capacity.max(1) {
            self.pop_front();
        }
    }

    fn pop_front(&mut self) {
        let Some((engine, _)) = self.ring.front().copied() else {
            return;
        };
        let head = self.head as u32;
        if let Ok(entry) = self.table.find_entry(key_hash(engine), |&seq| seq == head) {
            entry.remove();
        }
        self.ring.pop_front();
        self.head += 1;
    }

    /// Every ring slot, oldest first: (engine, own, live) — live slots are the entries.
    pub fn slots(&self) -> Vec<(u64, u64, bool)> {
        self.ring
            .iter()
            .enumerate()
            .map(|(i, &(engine, own))| {
                let seq = (self.head + i as u64) as u32;
                let live = self.table.find(key_hash(engine), |&s| s == seq).is_some();
                (engine, own, live)
            })
            .collect()
    }

    /// Live entries, oldest first.
    pub fn entries(&self) -> Vec<(u64, u64)> {
        self.slots()
            .into_iter()
            .filter(|s| s.2)
            .map(|(e, o, _)| (e, o))
            .collect()
    }

    /// The inverse of [`Recent::slots`]; None if two live slots name one engine hash.
    pub fn from_slots(slots: &[(u64, u64, bool)]) -> Option<Self> {
        let mut recent = Recent::default();
        for (i, &(engine, own, live)) in slots.iter().enumerate() {
            recent.ring.push_back((engine, own));
            if live {
                let ring = &recent.ring;
                if recent
                    .table
                    .find(key_hash(engine), |&s| ring[s as usize].0 == engine)
                    .is_some()
                {
                    return None;
                }
                recent
                    .table
                    .insert_unique(key_hash(engine), i as u32, |&s| {
                        key_hash(ring[s as usize].0)
                    });
            }
        }
        Some(recent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oldest_entries_go_first_and_reinsertion_refreshes() {
        let mut recent = Recent::default();
        for e in 0..10u64 {
            recent.insert(e, e + 100, 4);
        }
        assert_eq!(recent.len(), 4);
        assert_eq!(recent.get(5), None);
        assert_eq!(recent.get(6), Some(106));
        recent.insert(6, 206, 4); // newest again, with its new own hash
        recent.insert(10, 110, 4);
        assert_eq!(recent.get(6), Some(206));
        assert_eq!(recent.get(7), None);
        assert_eq!(
            recent.entries(),
            vec![(8, 108), (9, 109), (6, 206), (10, 110)]
        );
        let copy = Recent::from_slots(&recent.slots()).expect("valid");
        assert_eq!(copy.slots(), recent.slots());
        assert_eq!(copy.get(6), Some(206));
    }

    #[test]
    fn the_ring_never_exceeds_the_capacity() {
        let mut recent = Recent::default();
        for i in 0..100_000u64 {
            recent.insert(i % 3, i, 50);
        }
        assert_eq!(recent.len(), 3);
        assert!(recent.ring.len() <= 50);
        assert_eq!(recent.get(99_999 % 3), Some(99_999));
        assert_eq!(recent.entries().len(), 3);
    }
}
