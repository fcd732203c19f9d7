//! One worker's view and the per-worker operations of the index (stores, removals, moves,
//! clears, resets, store-only aging). A port of the Python reference's `PrefixIndex` private
//! methods, plus the cross-tier rule (`Recent`).

use std::collections::{BTreeMap, BTreeSet};

use hashbrown::hash_map::Entry;

use crate::flat::FlatMap;
use crate::hash::{self, Tokens};
use crate::lru::Lru;
use crate::recent::Recent;
use crate::space::{Space, TierSet, GPU, WORD_BITS};
use crate::spans;
use crate::stats::ApplyStats;
use crate::table::U64Map;

/// Store-only producers are swept at most this often per TTL (entries live ≤ TTL·(1+1/8)) …
pub const SWEEPS_PER_TTL: f64 = 8.0;
/// … and trimmed (down to capacity exactly) once they exceed capacity by 1/16.
pub const CAPACITY_SLACK_DIV: u64 = 16;

/// Blocks ahead whose cache lines a loop over an event's blocks starts loading (software
/// pipelining: a probe into a table far larger than the caches is one miss, and a few
/// independent ones in flight cost little more than one).
const AHEAD: usize = 8;

/// How many recently removed blocks a worker remembers (the cross-tier rule).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RecentPolicy {
    pub min_blocks: u64,
    pub peak_factor: f64,
}

impl Default for RecentPolicy {
    /// At least 4096 blocks, and an eighth of the most the worker ever held (an eighth of a
    /// turnover of its cache: far more than the lag between an offload's store and the GPU
    /// removal); 16 bytes per slot, 2 bytes per held block.
    fn default() -> Self {
        Self {
            min_blocks: 4096,
            peak_factor: 0.125,
        }
    }
}

/// A stored event as the index reads it.
#[derive(Clone, Copy, Debug)]
pub struct Stored<'a> {
    pub hashes: &'a [u64],
    pub parent: Option<u64>,
    pub tokens: Tokens<'a>,
    pub block_size: i64,
    pub lora_name: Option<&'a str>,
    pub tier: usize,
    pub group_idx: i64,
    pub full_attention: bool,
    /// Per block, the mix of its extra key (`None` for none), see [`hash::key_mixes`].
    pub extra_keys: &'a [Option<u64>],
}

#[derive(Debug)]
pub struct Worker {
    pub id: String,
    pub model: String,
    pub space: usize,
    pub slot: usize,
    pub block_size: u32,
    pub eagle: bool,
    /// engine hash → own hash.
    pub emap: FlatMap,
    /// Per tier: own → physical copies beyond the first (rare).
    pub dups: [U64Map<u32>; 4],
    /// Per tier: blocks held (copies beyond the first not counted).
    pub counts: [i64; 4],
    pub tiers: TierSet,
    pub nonfull_groups: BTreeSet<i64>,
    pub last_seq: BTreeMap<i64, i64>,
    pub approximate: bool,
    pub resets: u64,
    pub reset_reason: Option<String>,
    pub ttl_s: Option<f64>,
    pub capacity: Option<u64>,
    /// Sweep when the LRU grows past this.
    pub limit: Option<u64>,
    /// Store-only producers: own → (engine hash, last store/lookup), oldest first.
    pub lru: Option<Lru>,
    pub next_sweep_s: f64,
    /// Recently removed blocks (engine → own), for the cross-tier rule.
    pub recent: Recent,
    pub recent_policy: RecentPolicy,
    /// The most engine hashes this worker has mapped at once.
    pub peak: u64,
    /// Engine hash → the worker's blocks it spans, when more than one ([`spans`]).
    pub spans: U64Map<u32>,
}

impl Worker {
    pub fn new(
        id: &str,
        model: &str,
        space: usize,
        slot: usize,
        block_size: u32,
        policy: RecentPolicy,
    ) -> Self {
        Self {
            id: id.to_owned(),
            model: model.to_owned(),
            space,
            slot,
            block_size,
            eagle: false,
            emap: FlatMap::default(),
            dups: Default::default(),
            counts: [0; 4],
            tiers: TierSet::default(),
            nonfull_groups: BTreeSet::new(),
            last_seq: BTreeMap::new(),
            approximate: false,
            resets: 0,
            reset_reason: None,
            ttl_s: None,
            capacity: None,
            limit: None,
            lru: None,
            next_sweep_s: f64::INFINITY,
            recent: Recent::default(),
            recent_policy: policy,
            peak: 0,
            spans: U64Map::default(),
        }
    }

    #[inline]
    pub fn word(&self) -> usize {
        self.slot / WORD_BITS
    }

    #[inline]
    pub fn bit(&self) -> u64 {
        1 << (self.slot % WORD_BITS)
    }

    pub fn store_only(&self) -> bool {
        self.lru.is_some()
    }

    pub fn configure_store_only(&mut self, ttl_s: Option<f64>, capacity: Option<u64>) {
        self.ttl_s = ttl_s;
        self.capacity = capacity;
        self.limit = capacity.map(|c| c + c / CAPACITY_SLACK_DIV);
        if ttl_s.is_none() && capacity.is_none() {
            self.lru = None;
            self.next_sweep_s = f64::INFINITY;
        } else if self.lru.is_none() {
            // Blocks already held become the oldest, by engine hash (the order both
            // backends can give: the maps' own orders differ).
            let mut held: Vec<(u64, u64)> = self.emap.iter().collect();
            held.sort_unstable();
            let mut lru = Lru::default();
            for (engine, own) in held {
                if !lru.set_engine(own, engine) {
                    lru.push_back(own, engine, f64::NEG_INFINITY);
                }
            }
            self.lru = Some(lru);
            self.next_sweep_s = f64::NEG_INFINITY;
        }
    }

    pub fn recent_capacity(&self) -> usize {
        let scaled = (self.peak as f64 * self.recent_policy.peak_factor).ceil() as u64;
        scaled.max(self.recent_policy.min_blocks) as usize
    }

    /// An engine hash left the map: remember it for the cross-tier rule.
    fn forget_engine(&mut self, engine: u64, own: u64) {
        let capacity = self.recent_capacity();
        self.recent.insert(engine, own, capacity);
        if !self.spans.is_empty() {
            self.spans.remove(&engine);
        }
    }

    /// The own hash an engine hash names: the live map first, then the recently removed.
    pub fn resolve(&self, engine: u64) -> Option<(u64, bool)> {
        match self.emap.get(engine) {
            Some(own) => Some((own, false)),
            None => self.recent.get(engine).map(|own| (own, true)),
        }
    }

    /// Whether the worker holds `own` in any of its tiers other than `except`.
    fn holds_except(&self, space: &Space, own: u64, except: Option<usize>) -> bool {
        let (word, bit) = (self.word(), self.bit());
        self.tiers
            .iter()
            .filter(|&t| Some(t) != except)
            .any(|t| space.words[word][t].get(own).is_some_and(|m| m & bit != 0))
    }

    pub fn holds(&self, space: &Space, own: u64) -> bool {
        self.holds_except(space, own, None)
    }

    // ------------------------------------------------------------------ stores

    pub fn store(
        &mut self,
        space: &mut Space,
        salt: &[u8],
        event: &Stored<'_>,
        now_s: f64,
        stats: &mut ApplyStats,
    ) {
        // a tokenless store (an offload placeholder: no kind, no tokens) of a group known not
        // to be full attention is that group's too: it credits no prefix
        if !event.full_attention
            || (event.tokens.is_empty() && self.nonfull_groups.contains(&event.group_idx))
        {
            self.nonfull_groups.insert(event.group_idx);
            stats.ignored_blocks += event.hashes.len() as u64;
            return;
        }
        if event.tokens.is_empty() {
            if self.spans.is_empty() {
                self.move_blocks(space, event.hashes, event.tier, now_s, stats);
            } else {
                let hashes = spans::expand(&self.spans, event.hashes);
                self.move_blocks(space, &hashes, event.tier, now_s, stats);
            }
            return;
        }
        let (mut hashes, mut keys) = (event.hashes, event.extra_keys);
        let split;
        if event.block_size != i64::from(self.block_size) {
            let span = spans::span_of(event.block_size, self.block_size, hashes.len());
            if span == 0 {
                stats.block_size_mismatch_blocks += hashes.len() as u64;
                return;
            }
            if span > 1 {
                // LMCache's chunks: filed as the worker's blocks they span
                for &engine in hashes {
                    self.spans.insert(engine, span as u32);
                }
                split = spans::split(hashes, span, keys);
                (hashes, keys) = (&split.0, &split.1);
            }
        }
        let mut seed = None;
        if let Some(parent) = event.parent {
            match self.resolve(parent) {
                Some((own, recovered)) => {
                    stats.recovered_parents += u64::from(recovered);
                    seed = Some(own);
                }
                None => stats.unknown_parents += 1,
            }
        }
        let seed = seed.unwrap_or_else(|| space.seed(salt, event.lora_name));
        let size = self.block_size as usize;
        let owns = hash::chain(seed, event.tokens, size, keys, None);
        let n = owns.len().min(hashes.len());
        if owns.len() != hashes.len() {
            stats.malformed_blocks += owns.len().abs_diff(hashes.len()) as u64;
            hashes = &hashes[..n];
        }
        self.add(space, hashes, &owns[..n], event.tier, now_s, stats);
    }

    /// A store without token ids (offload connectors): the blocks moved or were copied to
    /// another tier.
    fn move_blocks(
        &mut self,
        space: &mut Space,
        hashes: &[u64],
        tier: usize,
        now_s: f64,
        stats: &mut ApplyStats,
    ) {
        let mut known = Vec::with_capacity(hashes.len());
        let mut owns = Vec::with_capacity(hashes.len());
        for &engine in hashes {
            match self.resolve(engine) {
                Some((own, recovered)) => {
                    stats.recovered_moves += u64::from(recovered);
                    known.push(engine);
                    owns.push(own);
                }
                None => stats.unknown_moves += 1,
            }
        }
        self.add(space, &known, &owns, tier, now_s, stats);
    }

    /// Files stored blocks: engine map, then this worker's bit in the tier's table.
    pub fn add(
        &mut self,
        space: &mut Space,
        hashes: &[u64],
        owns: &[u64],
        tier: usize,
        now_s: f64,
        stats: &mut ApplyStats,
    ) {
        let (word, bit) = (self.word(), self.bit());
        let n = hashes.len();
        for &engine in &hashes[..n.min(AHEAD)] {
            self.emap.prefetch_run(engine);
        }
        for &own in &owns[..n.min(AHEAD)] {
            space.words[word][tier].prefetch_run(own);
        }
        // Pass 1 (the reference's setdefault pass), then the re-mapped engine hashes.
        let mut remaps: Vec<(usize, u64)> = Vec::new();
        for (i, (&engine, &own)) in hashes.iter().zip(owns).enumerate() {
            if let Some(&ahead) = hashes.get(i + AHEAD) {
                self.emap.prefetch_run(ahead);
            }
            let (inserted, old) = self.emap.get_or_insert(engine, own);
            if !inserted && *old != own {
                remaps.push((i, *old));
            }
        }
        for (i, old) in remaps {
            // An engine hash now names other content (its parent was unknown before, say):
            // what was filed under the old own hash is dropped for this worker.
            stats.remapped_blocks += 1;
            self.forget(space, old);
            self.emap.insert(hashes[i], owns[i]);
        }
        self.tiers.insert(tier);
        stats.stored_blocks += owns.len() as u64;
        let table = &mut space.words[word][tier];
        for (i, &own) in owns.iter().enumerate() {
            if let Some(&ahead) = owns.get(i + AHEAD) {
                table.prefetch_run(ahead);
            }
            let (inserted, mask) = table.get_or_insert(own, bit);
            if inserted {
                self.counts[tier] += 1;
            } else if *mask & bit != 0 {
                *self.dups[tier].entry(own).or_insert(0) += 1;
                stats.duplicate_stores += 1;
            } else {
                *mask |= bit;
                self.counts[tier] += 1;
            }
        }
        if let Some(lru) = self.lru.as_mut() {
            lru.touch(hashes, owns, now_s);
        }
        self.peak = self.peak.max(self.emap.len() as u64);
    }

    // ------------------------------------------------------------------ removals

    pub fn remove(
        &mut self,
        space: &mut Space,
        hashes: &[u64],
        tier: usize,
        group_idx: i64,
        stats: &mut ApplyStats,
    ) {
        if self.nonfull_groups.contains(&group_idx) {
            stats.ignored_blocks += hashes.len() as u64;
            return;
        }
        let expanded;
        let hashes = if self.spans.is_empty() {
            hashes
        } else {
            expanded = spans::expand(&self.spans, hashes);
            &expanded[..]
        };
        let (word, bit) = (self.word(), self.bit());
        // A two-stage pipeline: 2·AHEAD blocks ahead the engine map's and the recently
        // removed cache's lines start loading; AHEAD blocks ahead the engine map (in cache
        // by then) names the own hash, whose table lines start loading.
        let n = hashes.len();
        for &engine in &hashes[..n.min(2 * AHEAD)] {
            self.emap.prefetch_run(engine);
            self.recent.prefetch(engine);
        }
        for &engine in &hashes[..n.min(AHEAD)] {
            if let Some(own) = self.emap.get(engine) {
                space.words[word][tier].prefetch_run(own);
            }
        }
        for (i, &engine) in hashes.iter().enumerate() {
            if let Some(&ahead) = hashes.get(i + 2 * AHEAD) {
                self.emap.prefetch_run(ahead);
                self.recent.prefetch(ahead);
            }
            if let Some(own) = hashes.get(i + AHEAD).and_then(|&e| self.emap.get(e)) {
                space.words[word][tier].prefetch_run(own);
            }
            let Some(own) = self.emap.get(engine) else {
                stats.unknown_removals += 1;
                continue;
            };
            if self.dups[tier].is_empty() {
                // the usual case: no duplicate copies
            } else if let Entry::Occupied(mut extra) = self.dups[tier].entry(own) {
                if *extra.get() > 1 {
                    *extra.get_mut() -= 1;
                } else {
                    extra.remove();
                }
                stats.removed_blocks += 1;
                continue;
            }
            let table = &mut space.words[word][tier];
            let held = table.update_or_remove(own, |m| if m & bit != 0 { m ^ bit } else { m });
            if held.is_none_or(|m| m & bit == 0) {
                stats.absent_removals += 1;
                continue;
            }
            self.counts[tier] -= 1;
            stats.removed_blocks += 1;
            if !self.holds_except(space, own, Some(tier)) {
                self.emap.remove(engine);
                self.forget_engine(engine, own);
                if let Some(lru) = self.lru.as_mut() {
                    lru.untouch(&[own]);
                }
            }
        }
    }

    /// Drops every copy of one block on this worker, in every tier.
    pub fn forget(&mut self, space: &mut Space, own: u64) {
        let (word, bit) = (self.word(), self.bit());
        for tier in self.tiers.iter() {
            let table = &mut space.words[word][tier];
            if table
                .update_or_remove(own, |m| m & !bit)
                .is_some_and(|m| m & bit != 0)
            {
                self.counts[tier] -= 1;
            }
            self.dups[tier].remove(&own);
        }
        let engine = self.lru.as_mut().and_then(|lru| lru.untouch(&[own]));
        if let Some(engine) = engine {
            if self.emap.get(engine) == Some(own) {
                self.emap.remove(engine);
                self.forget_engine(engine, own);
            }
        }
    }

    /// Clear-all, for one tier or all of them.
    pub fn clear(&mut self, space: &mut Space, tier: Option<usize>) {
        let tiers: Vec<usize> = match tier {
            None => self.tiers.iter().collect(),
            Some(t) => vec![t],
        };
        let (word, bit) = (self.word(), self.bit());
        for &t in &tiers {
            let table = &mut space.words[word][t];
            for own in self.emap.values() {
                table.update_or_remove(own, |m| m & !bit);
            }
            self.counts[t] = 0;
            self.dups[t] = U64Map::default();
        }
        let Some(tier) = tier else {
            self.emap = FlatMap::default();
            self.spans = U64Map::default();
            self.tiers = TierSet::default();
            self.approximate = false;
            if let Some(lru) = self.lru.as_mut() {
                lru.clear();
            }
            self.recent.clear();
            return;
        };
        self.tiers.remove(tier);
        let mut gone: Vec<(u64, u64)> = self
            .emap
            .iter()
            .filter(|&(_, own)| !self.holds(space, own))
            .collect();
        // remembered by engine hash (the order both backends can give)
        gone.sort_unstable();
        for (engine, own) in gone {
            self.emap.remove(engine);
            self.forget_engine(engine, own);
            if let Some(lru) = self.lru.as_mut() {
                lru.untouch(&[own]);
            }
        }
    }

    pub fn reset(
        &mut self,
        space: &mut Space,
        reason: &str,
        approximate: bool,
        stats: &mut ApplyStats,
    ) {
        self.clear(space, None);
        self.approximate = approximate;
        self.resets += 1;
        self.reset_reason = Some(reason.to_owned());
        stats.resets += 1;
    }

    // ------------------------------------------------------------------ store-only

    pub fn sweep_due(&self, now_s: f64) -> bool {
        let over = match (self.limit, self.lru.as_ref()) {
            (Some(limit), Some(lru)) => lru.len() as u64 > limit,
            _ => false,
        };
        now_s >= self.next_sweep_s || over
    }

    pub fn schedule_sweep(&mut self, now_s: f64) {
        self.next_sweep_s = match self.ttl_s {
            None => f64::INFINITY,
            Some(ttl) => now_s + ttl / SWEEPS_PER_TTL,
        };
    }

    /// Oldest first: blocks past the TTL, then the least recent beyond capacity.
    fn victims(&self, now_s: f64) -> (Vec<u64>, Vec<u64>) {
        let Some(lru) = self.lru.as_ref() else {
            return (Vec::new(), Vec::new());
        };
        let cutoff = self.ttl_s.map_or(f64::NEG_INFINITY, |ttl| now_s - ttl);
        let excess = self.capacity.map_or(0, |c| {
            lru.len() as i64 - i64::try_from(c).unwrap_or(i64::MAX)
        });
        let (mut expired, mut trimmed) = (Vec::new(), Vec::new());
        for (own, _, last_s) in lru.iter() {
            if last_s < cutoff {
                expired.push(own);
            } else if ((expired.len() + trimmed.len()) as i64) < excess {
                trimmed.push(own);
            } else {
                break;
            }
        }
        (expired, trimmed)
    }

    /// Age out (TTL) and trim (capacity, least recently stored or looked up first).
    pub fn sweep(&mut self, space: &mut Space, now_s: f64, stats: &mut ApplyStats) {
        let (expired, trimmed) = self.victims(now_s);
        for &own in expired.iter().chain(&trimmed) {
            self.forget(space, own);
        }
        stats.expired_blocks += expired.len() as u64;
        stats.trimmed_blocks += trimmed.len() as u64;
        self.schedule_sweep(now_s);
    }

    /// Approximate mode: a served prompt's own hashes are filed as cached in the GPU tier,
    /// tail first (so the LRU drops a prompt's tail before its prefix). Returns the number
    /// of blocks newly filed.
    pub fn observe_served(
        &mut self,
        space: &mut Space,
        own_hashes: &[u64],
        now_s: f64,
        stats: &mut ApplyStats,
    ) -> usize {
        if self.lru.is_none() || own_hashes.is_empty() {
            return 0;
        }
        let owns: Vec<u64> = own_hashes.iter().rev().copied().collect();
        let (word, bit) = (self.word(), self.bit());
        let table = &space.words[word][GPU];
        let new: Vec<u64> = owns
            .iter()
            .copied()
            .filter(|&own| table.get(own).is_none_or(|m| m & bit == 0))
            .collect();
        if !new.is_empty() {
            self.add(space, &new, &new, GPU, now_s, stats);
        }
        if let Some(lru) = self.lru.as_mut() {
            lru.touch(&owns, &owns, now_s); // refresh the blocks it held already
        }
        let len = self.lru.as_ref().map_or(0, |l| l.len() as u64);
        if self.sweep_due(now_s) || self.capacity.is_some_and(|c| len > c) {
            self.sweep(space, now_s, stats);
        }
        new.len()
    }
}
