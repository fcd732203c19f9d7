//! One pass over a prompt's blocks for every worker of a space.
//!
//! Per block and 64-slot word: the masks of the word's non-empty tier tables, fastest tier
//! first, stopping as soon as their union covers the workers still matching (a slower tier
//! can then neither extend a prefix nor be any block's fastest tier); a running AND down the
//! prompt (`alive` = workers holding blocks 0..=i); where `alive` loses bits, those workers'
//! prefixes end. When a word has more than one non-empty tier, per slower tier the blocks
//! whose fastest holding tier it is are counted, by runs of equal masks; the fastest tier's
//! share is what remains of each prefix.
//!
//! The prompt is hashed lazily in chunks that grow from 64 to 1024 blocks, so a prompt
//! nobody holds costs one small chunk.

use crate::hash::{self, Tokens};
use crate::index::Hit;
use crate::space::{MaskTable, Space, TIERS, WORD_BITS};
use crate::worker::Worker;

pub const FIRST_CHUNK_BLOCKS: usize = 64;
pub const MAX_CHUNK_BLOCKS: usize = 1024;
/// How many blocks ahead the walk prefetches the fastest tier's table slot.
pub const PREFETCH_AHEAD: usize = 8;

pub enum Source<'a> {
    /// Precomputed own hashes.
    Hashes(&'a [u64]),
    /// Token ids, hashed in chunks as the walk needs them.
    Tokens {
        tokens: Tokens<'a>,
        seed: u64,
        extra_keys: &'a [Option<u64>],
    },
}

pub struct Matched {
    /// Per slot: matched blocks (before the EAGLE rule).
    ends: Vec<usize>,
    /// Per slot and tier: blocks whose fastest tier it is (the word's fastest tier: 0 here).
    tier_blocks: Vec<[u64; 4]>,
    /// Per word: the fastest tier with entries.
    fastest: Vec<usize>,
    hashes: Vec<u64>,
}

/// A run of blocks with equal per-tier "fastest here" masks.
#[derive(Clone, Copy, Default)]
struct Run {
    mask: u64,
    len: u64,
}

struct WordWalk<'a> {
    word: usize,
    /// The word's non-empty tables, fastest first.
    tables: Vec<(usize, &'a MaskTable)>,
    alive: u64,
    runs: [Run; 4],
}

impl Matched {
    pub fn blocks(&self, slot: usize) -> usize {
        self.ends[slot]
    }

    pub fn hashes(&self) -> &[u64] {
        &self.hashes
    }

    fn end(&mut self, word: usize, mut bits: u64, blocks: usize) {
        let base = word * WORD_BITS;
        while bits != 0 {
            let low = bits.trailing_zeros() as usize;
            self.ends[base + low] = blocks;
            bits &= bits - 1;
        }
    }

    fn flush(&mut self, word: usize, tier: usize, run: Run) {
        let base = word * WORD_BITS;
        let mut bits = run.mask;
        while bits != 0 {
            let low = bits.trailing_zeros() as usize;
            self.tier_blocks[base + low][tier] += run.len;
            bits &= bits - 1;
        }
    }

    pub fn hit(&self, space: &Space, worker: &Worker) -> Hit {
        let matched = self.ends[worker.slot];
        let approximate = worker.approximate || worker.store_only();
        let size = u64::from(worker.block_size);
        let zero = Hit {
            block_size: worker.block_size,
            approximate,
            ..Default::default()
        };
        if matched == 0 || (matched == 1 && worker.eagle) {
            return zero;
        }
        let mut per_tier = self.tier_blocks[worker.slot];
        let fastest = self.fastest[worker.word()];
        let others: u64 = per_tier.iter().sum::<u64>() - per_tier[fastest];
        per_tier[fastest] = matched as u64 - others;
        let mut matched = matched as u64;
        if worker.eagle {
            // the last matched block is recomputed: not credited
            matched -= 1;
            let own = self.hashes[matched as usize];
            let best = (0..TIERS.len())
                .find(|&t| {
                    space.words[worker.word()][t]
                        .get(own)
                        .is_some_and(|m| m & worker.bit() != 0)
                })
                .expect("a matched block is held in some tier");
            per_tier[best] -= 1;
        }
        Hit {
            block_size: worker.block_size,
            tokens: matched * size,
            tiers: per_tier.map(|n| n * size),
            approximate,
        }
    }
}

/// Matches the prompt against every worker of the space; stops hashing once no worker
/// still matches.
pub fn walk(space: &Space, source: Source<'_>) -> Matched {
    let slots = space.slots.len();
    let mut matched = Matched {
        ends: vec![0; slots],
        tier_blocks: vec![[0; 4]; slots],
        fastest: vec![0; space.occupied.len()],
        hashes: Vec::new(),
    };
    let mut words: Vec<WordWalk<'_>> = space
        .occupied
        .iter()
        .enumerate()
        .filter(|&(_, &bits)| bits != 0)
        .map(|(word, &bits)| {
            let tables: Vec<(usize, &MaskTable)> = space.words[word]
                .iter()
                .enumerate()
                .filter(|(_, t)| !t.is_empty())
                .collect();
            WordWalk {
                word,
                tables,
                alive: bits,
                runs: [Run::default(); 4],
            }
        })
        .collect();
    for w in &words {
        if let Some(&(tier, _)) = w.tables.first() {
            matched.fastest[w.word] = tier;
        }
    }
    match source {
        Source::Hashes(hashes) => {
            matched.hashes = hashes.to_vec();
            walk_chunk(&mut matched, &mut words, 0);
        }
        Source::Tokens {
            tokens,
            seed,
            extra_keys,
        } => {
            let size = space.block_size as usize;
            let total = tokens.blocks(size);
            let (mut start, mut step, mut prev) = (0, FIRST_CHUNK_BLOCKS, seed);
            while start < total && words.iter().any(|w| w.alive != 0) {
                let stop = total.min(start + step);
                let mut chunk = std::mem::take(&mut matched.hashes);
                prev = hash::chain_range(prev, tokens, size, extra_keys, start, stop, &mut chunk);
                matched.hashes = chunk;
                walk_chunk(&mut matched, &mut words, start);
                start = stop;
                step = (step * 4).min(MAX_CHUNK_BLOCKS);
            }
        }
    }
    let total = matched.hashes.len();
    for w in &words {
        if w.alive != 0 {
            matched.end(w.word, w.alive, total);
        }
        for (tier, run) in w.runs.iter().enumerate() {
            matched.flush(w.word, tier, *run);
        }
    }
    matched
}

/// Walks the hashes from `start` on for every word still alive.
fn walk_chunk(matched: &mut Matched, words: &mut [WordWalk<'_>], start: usize) {
    for w in words.iter_mut() {
        if w.alive == 0 {
            continue;
        }
        if w.tables.is_empty() {
            matched.end(w.word, w.alive, start);
            w.alive = 0;
            continue;
        }
        let multi = w.tables.len() > 1;
        let mut carry = w.alive;
        let end = matched.hashes.len();
        // The fastest table's slot of the block PREFETCH_AHEAD on is loaded while this one
        // is matched: in a table larger than the caches each probe is a miss, and the walk
        // would otherwise wait for them one after the other.
        let fastest = w.tables[0].1;
        for &own in &matched.hashes[start..end.min(start + PREFETCH_AHEAD)] {
            fastest.prefetch(own);
        }
        for i in start..end {
            if let Some(&ahead) = matched.hashes.get(i + PREFETCH_AHEAD) {
                fastest.prefetch(ahead);
            }
            let own = matched.hashes[i];
            let mut grid = [0u64; 4];
            let mut union = 0u64;
            for (k, (_, table)) in w.tables.iter().enumerate() {
                let mask = table.get(own).unwrap_or(0);
                grid[k] = mask;
                union |= mask;
                if union & carry == carry {
                    break; // the slower tiers cannot change anything for these workers
                }
            }
            let next = carry & union;
            if next != carry {
                matched.end(w.word, carry & !next, i);
                carry = next;
                if carry == 0 {
                    break;
                }
            }
            if multi {
                let mut faster = grid[0];
                for (&mask, &(tier, _)) in grid.iter().zip(&w.tables).skip(1) {
                    let best = mask & !faster & carry;
                    faster |= mask;
                    let run = &mut w.runs[tier];
                    if best == run.mask {
                        run.len += 1;
                    } else {
                        let done = *run;
                        *run = Run { mask: best, len: 1 };
                        matched.flush(w.word, tier, done);
                    }
                }
            }
        }
        w.alive = carry;
    }
}
