//! One (model, block size) hash space: worker slots (one bit each) and, per 64-slot word and
//! tier, a table own hash → bits of the workers holding that block in that tier.

use crate::flat::FlatMap;
use crate::hash;

pub const TIERS: [&str; 4] = ["GPU", "CPU", "DISK", "SHARED"]; // fastest first
pub const GPU: usize = 0;
pub const WORD_BITS: usize = 64;

pub fn tier_index(name: &str) -> Option<usize> {
    TIERS.iter().position(|t| *t == name)
}

/// A bitset of tiers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierSet(pub u8);

impl TierSet {
    pub fn contains(self, tier: usize) -> bool {
        self.0 & (1 << tier) != 0
    }

    pub fn insert(&mut self, tier: usize) {
        self.0 |= 1 << tier;
    }

    pub fn remove(&mut self, tier: usize) {
        self.0 &= !(1 << tier);
    }

    pub fn len(self) -> usize {
        self.0.count_ones() as usize
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Tiers in order, fastest first.
    pub fn iter(self) -> impl Iterator<Item = usize> {
        (0..TIERS.len()).filter(move |&t| self.contains(t))
    }
}

/// own hash → mask of the workers (of one word) holding the block in one tier.
pub type MaskTable = FlatMap;

#[derive(Debug, Default)]
pub struct Space {
    pub model: String,
    pub block_size: u32,
    /// `words[word][tier]`.
    pub words: Vec<[MaskTable; 4]>,
    /// slot → worker (its index in the index's worker slab).
    pub slots: Vec<Option<usize>>,
    /// Per word: bits of the slots in use.
    pub occupied: Vec<u64>,
    /// The root seed without a LoRA adapter (the common case), cached.
    root: u64,
}

impl Space {
    pub fn new(model: &str, block_size: u32, salt: &[u8]) -> Self {
        Self {
            model: model.to_owned(),
            block_size,
            root: hash::root_seed(salt, model, i64::from(block_size), None),
            ..Default::default()
        }
    }

    pub fn seed(&self, salt: &[u8], lora_name: Option<&str>) -> u64 {
        match lora_name {
            None => self.root,
            Some(_) => hash::root_seed(salt, &self.model, i64::from(self.block_size), lora_name),
        }
    }

    /// The first free slot (a new one at the end if none is free).
    pub fn take_slot(&self) -> usize {
        self.slots
            .iter()
            .position(Option::is_none)
            .unwrap_or(self.slots.len())
    }

    pub fn grow(&mut self, slot: usize) {
        let words = slot / WORD_BITS + 1;
        while self.words.len() < words {
            self.words.push(Default::default());
        }
        while self.occupied.len() < words {
            self.occupied.push(0);
        }
    }

    pub fn place(&mut self, slot: usize, worker: usize) {
        if self.slots.len() <= slot {
            self.slots.resize(slot + 1, None);
        }
        self.grow(slot);
        self.slots[slot] = Some(worker);
        self.occupied[slot / WORD_BITS] |= 1 << (slot % WORD_BITS);
    }

    pub fn free(&mut self, slot: usize) {
        self.slots[slot] = None;
        self.occupied[slot / WORD_BITS] &= !(1 << (slot % WORD_BITS));
    }

    /// Workers of the space, in slot order.
    pub fn workers(&self) -> impl Iterator<Item = usize> + '_ {
        self.slots.iter().filter_map(|w| *w)
    }

    /// Table entries per tier (summed over words).
    pub fn entries(&self) -> [usize; 4] {
        let mut out = [0; 4];
        for word in &self.words {
            for (tier, table) in word.iter().enumerate() {
                out[tier] += table.len();
            }
        }
        out
    }
}
