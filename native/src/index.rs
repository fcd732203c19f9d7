//! The live KV-cache index: a port of the Python reference's `PrefixIndex` (pure, no I/O).
//!
//! * A *space* per (model, block size) names blocks by the own chained content hash
//!   ([`crate::hash`]). Each worker of the space owns one bit (its slot); for every tier and
//!   every 64 slots the space keeps a table own hash → bitmask of the workers holding that
//!   block in that tier. A lookup reads one mask per block and tier and walks all workers of
//!   the space at once ([`crate::walk`]).
//! * Per worker ([`Worker`]), a map engine hash → own hash, so removals (which carry only
//!   engine hashes) resolve, plus the rare extras: duplicate physical copies, the store-only
//!   LRU, and the recently removed blocks (the cross-tier rule, [`crate::recent`]).

use std::collections::HashMap;

use crate::flat::FlatMap;
use crate::hash::{self, Tokens};
use crate::space::{Space, TIERS};
use crate::stats::ApplyStats;
use crate::walk;
use crate::worker::{RecentPolicy, Stored, Worker};

/// One event of an engine batch, as the index reads it.
#[derive(Clone, Copy, Debug)]
pub enum Event<'a> {
    Stored(Stored<'a>),
    Removed {
        hashes: &'a [u64],
        tier: usize,
        group_idx: i64,
    },
    /// Clear-all, of one tier or (None) of all of them.
    Cleared {
        tier: Option<usize>,
    },
    /// Ingest lost events: forget the worker, flag it approximate until a full clear —
    /// unless `approximate` is false (an engine restart: the new stream starts empty).
    Reset {
        reason: &'a str,
        approximate: bool,
    },
}

/// One worker's cached prefix of a prompt (tokens; `tiers` in the order of [`TIERS`], each
/// block counted in the fastest tier holding it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hit {
    pub block_size: u32,
    pub tokens: u64,
    pub tiers: [u64; 4],
    pub approximate: bool,
}

/// A registration the index refuses (the messages are the reference's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IndexError {
    BadBlockSize(i64),
    BadTtl,
    BadCapacity,
}

impl std::fmt::Display for IndexError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IndexError::BadBlockSize(b) => write!(f, "block_size must be >= 1, got {b}"),
            IndexError::BadTtl => write!(f, "store_only_ttl_s must be > 0"),
            IndexError::BadCapacity => write!(f, "capacity_blocks must be >= 1"),
        }
    }
}

impl std::error::Error for IndexError {}

/// A worker's state as `stats()` reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerStats {
    pub worker_id: String,
    pub model: String,
    pub block_size: u32,
    pub eagle: bool,
    pub store_only: bool,
    pub approximate: bool,
    pub resets: u64,
    pub last_reset_reason: Option<String>,
    pub last_seq: Vec<(i64, i64)>,
    pub blocks: [i64; 4],
    pub engine_hashes: usize,
    pub duplicate_copies: u64,
    /// Beyond the reference: recently removed blocks remembered (cross-tier rule).
    pub recently_removed: usize,
    /// Slots of the recently removed cache, and the peak of engine hashes held.
    pub recent_capacity: usize,
    pub peak_engine_hashes: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SpaceStats {
    pub model: String,
    pub block_size: u32,
    pub workers: usize,
    pub entries: [usize; 4],
}

#[derive(Debug, Default)]
pub struct Index {
    pub(crate) salt: Vec<u8>,
    pub(crate) policy: RecentPolicy,
    /// Worker slab; `order` lists the live ones in registration order.
    pub(crate) workers: Vec<Option<Worker>>,
    pub(crate) order: Vec<usize>,
    pub(crate) by_id: HashMap<String, usize>,
    /// Spaces in creation order.
    pub(crate) spaces: Vec<Space>,
    pub(crate) space_by_key: HashMap<(String, u32), usize>,
    /// model → its spaces, by block size.
    pub(crate) models: HashMap<String, Vec<usize>>,
    pub(crate) totals: ApplyStats,
}

impl Index {
    pub fn new(salt: &[u8], policy: RecentPolicy) -> Self {
        Self {
            salt: salt.to_vec(),
            policy,
            ..Default::default()
        }
    }

    pub fn salt(&self) -> &[u8] {
        &self.salt
    }

    pub fn policy(&self) -> RecentPolicy {
        self.policy
    }

    // ------------------------------------------------------------------ workers

    /// Adds a worker (or updates its flags; a new model or block size starts it afresh).
    pub fn register_worker(
        &mut self,
        worker_id: &str,
        model: &str,
        block_size: i64,
        eagle: bool,
        store_only_ttl_s: Option<f64>,
        capacity_blocks: Option<i64>,
    ) -> Result<(), IndexError> {
        let size = u32::try_from(block_size)
            .ok()
            .filter(|&b| b >= 1)
            .ok_or(IndexError::BadBlockSize(block_size))?;
        if let Some(ttl) = store_only_ttl_s {
            if ttl.is_nan() || ttl <= 0.0 {
                return Err(IndexError::BadTtl);
            }
        }
        let capacity = match capacity_blocks {
            None => None,
            Some(c) if c >= 1 => Some(c as u64),
            Some(_) => return Err(IndexError::BadCapacity),
        };
        if let Some(&wi) = self.by_id.get(worker_id) {
            let w = self.workers[wi].as_ref().expect("registered");
            if w.model != model || w.block_size != size {
                self.remove_worker(worker_id);
            }
        }
        let wi = match self.by_id.get(worker_id) {
            Some(&wi) => wi,
            None => {
                let si = self.space_index(model, size);
                let space = &mut self.spaces[si];
                let slot = space.take_slot();
                let wi = self
                    .workers
                    .iter()
                    .position(Option::is_none)
                    .unwrap_or(self.workers.len());
                if wi == self.workers.len() {
                    self.workers.push(None);
                }
                space.place(slot, wi);
                self.workers[wi] = Some(Worker::new(worker_id, model, si, slot, size, self.policy));
                self.by_id.insert(worker_id.to_owned(), wi);
                self.order.push(wi);
                wi
            }
        };
        let worker = self.workers[wi].as_mut().expect("registered");
        worker.eagle = eagle;
        worker.configure_store_only(store_only_ttl_s, capacity);
        Ok(())
    }

    pub fn remove_worker(&mut self, worker_id: &str) {
        let Some(wi) = self.by_id.remove(worker_id) else {
            return;
        };
        let mut worker = self.workers[wi].take().expect("registered");
        let space = &mut self.spaces[worker.space];
        worker.clear(space, None);
        space.free(worker.slot);
        self.order.retain(|&w| w != wi);
    }

    /// Forgets a worker's blocks (e.g. an unrepairable sequence gap); its hits are then
    /// flagged approximate until the engine clears its whole cache.
    pub fn reset_worker(&mut self, worker_id: &str, reason: &str) {
        let Some(&wi) = self.by_id.get(worker_id) else {
            return;
        };
        let mut stats = ApplyStats::default();
        let worker = self.workers[wi].as_mut().expect("registered");
        worker.reset(&mut self.spaces[worker.space], reason, true, &mut stats);
        self.totals.add(&stats);
    }

    fn space_index(&mut self, model: &str, block_size: u32) -> usize {
        let key = (model.to_owned(), block_size);
        if let Some(&si) = self.space_by_key.get(&key) {
            return si;
        }
        let si = self.spaces.len();
        self.spaces.push(Space::new(model, block_size, &self.salt));
        self.space_by_key.insert(key, si);
        let list = self.models.entry(model.to_owned()).or_default();
        list.push(si);
        let spaces = &self.spaces;
        list.sort_by_key(|&s| spaces[s].block_size);
        si
    }

    pub(crate) fn worker(&self, worker_id: &str) -> Option<&Worker> {
        self.by_id
            .get(worker_id)
            .and_then(|&wi| self.workers[wi].as_ref())
    }

    pub fn has_worker(&self, worker_id: &str) -> bool {
        self.by_id.contains_key(worker_id)
    }

    /// Block sizes of the model's spaces, ascending.
    pub fn block_sizes(&self, model: &str) -> Vec<u32> {
        self.models
            .get(model)
            .map(|l| l.iter().map(|&s| self.spaces[s].block_size).collect())
            .unwrap_or_default()
    }

    // ------------------------------------------------------------------ events

    /// Applies one normalized engine batch; `now_s` is a monotonic clock. The returned
    /// stats are also summed into [`Index::totals`].
    pub fn apply(
        &mut self,
        worker_id: &str,
        model: &str,
        seq: i64,
        dp_rank: i64,
        events: &[Event<'_>],
        now_s: f64,
    ) -> ApplyStats {
        let mut stats = ApplyStats {
            batches: 1,
            ..Default::default()
        };
        let Some(&wi) = self.by_id.get(worker_id) else {
            stats.unknown_worker_batches = 1;
            self.totals.add(&stats);
            return stats;
        };
        let worker = self.workers[wi].as_mut().expect("registered");
        if worker.model != model {
            stats.model_mismatch_batches = 1;
            self.totals.add(&stats);
            return stats;
        }
        let space = &mut self.spaces[worker.space];
        for event in events {
            match event {
                Event::Stored(stored) => worker.store(space, &self.salt, stored, now_s, &mut stats),
                Event::Removed {
                    hashes,
                    tier,
                    group_idx,
                } => worker.remove(space, hashes, *tier, *group_idx, &mut stats),
                Event::Cleared { tier } => {
                    worker.clear(space, *tier);
                    stats.clears += 1;
                }
                Event::Reset {
                    reason,
                    approximate,
                } => worker.reset(space, reason, *approximate, &mut stats),
            }
        }
        worker.last_seq.insert(dp_rank, seq);
        if worker.store_only() && worker.sweep_due(now_s) {
            worker.sweep(space, now_s, &mut stats);
        }
        self.totals.add(&stats);
        stats
    }

    /// Approximate mode: a prompt (its own hashes in the worker's space) was served by a
    /// worker that publishes no KV events; only store-only workers learn this way. Returns
    /// the number of blocks newly filed.
    pub fn observe_served(&mut self, worker_id: &str, own_hashes: &[u64], now_s: f64) -> usize {
        let Some(&wi) = self.by_id.get(worker_id) else {
            return 0;
        };
        let worker = self.workers[wi].as_mut().expect("registered");
        let mut stats = ApplyStats::default();
        let new = worker.observe_served(
            &mut self.spaces[worker.space],
            own_hashes,
            now_s,
            &mut stats,
        );
        self.totals.add(&stats);
        new
    }

    /// Sweeps the store-only workers whose sweep is due (cheap when none is).
    pub fn age(&mut self, now_s: f64) {
        let mut stats = ApplyStats::default();
        for &wi in &self.order {
            let worker = self.workers[wi].as_mut().expect("registered");
            if worker.store_only() && worker.sweep_due(now_s) {
                worker.sweep(&mut self.spaces[worker.space], now_s, &mut stats);
            }
        }
        self.totals.add(&stats);
    }

    /// Ages out store-only entries of every worker now (`apply` does it lazily).
    pub fn maintain(&mut self, now_s: f64) -> ApplyStats {
        let mut stats = ApplyStats::default();
        for &wi in &self.order {
            let worker = self.workers[wi].as_mut().expect("registered");
            if worker.store_only() {
                worker.sweep(&mut self.spaces[worker.space], now_s, &mut stats);
            }
        }
        self.totals.add(&stats);
        stats
    }

    // ------------------------------------------------------------------ lookups

    /// Own hashes of the prompt's full blocks in the (model, block size) space.
    pub fn hash_prompt(
        &self,
        model: &str,
        block_size: usize,
        tokens: Tokens<'_>,
        lora_name: Option<&str>,
        extra_keys: &[Option<u64>],
    ) -> Vec<u64> {
        let seed = hash::root_seed(&self.salt, model, block_size as i64, lora_name);
        hash::chain(seed, tokens, block_size, extra_keys, None)
    }

    /// Longest cached prefix of every worker of `model`, per tier, in one pass per space.
    ///
    /// `own_hashes` (block size → own hashes) wins over `tokens` for the block sizes it
    /// covers. `now_s` refreshes the matched blocks of store-only workers. Returns
    /// (worker id, hit) by block size, then slot.
    pub fn lookup(
        &mut self,
        model: &str,
        tokens: Option<Tokens<'_>>,
        own_hashes: &[(u32, &[u64])],
        lora_name: Option<&str>,
        extra_keys: &[Option<u64>],
        now_s: Option<f64>,
    ) -> Vec<(&str, Hit)> {
        let Some(list) = self.models.get(model) else {
            return Vec::new();
        };
        let mut found: Vec<(usize, Hit)> = Vec::new();
        for &si in list {
            let space = &self.spaces[si];
            let given = own_hashes
                .iter()
                .find(|(size, _)| *size == space.block_size)
                .map(|(_, h)| *h);
            let source = match (given, tokens) {
                (Some(hashes), _) => walk::Source::Hashes(hashes),
                (None, Some(tokens)) => walk::Source::Tokens {
                    tokens,
                    seed: space.seed(&self.salt, lora_name),
                    extra_keys,
                },
                (None, None) => walk::Source::Hashes(&[]),
            };
            let matched = walk::walk(space, source);
            for wi in space.workers() {
                let worker = self.workers[wi].as_mut().expect("placed");
                let hit = matched.hit(space, worker);
                found.push((wi, hit));
                if let (Some(now_s), Some(lru)) = (now_s, worker.lru.as_mut()) {
                    if hit.tokens > 0 {
                        lru.refresh(&matched.hashes()[..matched.blocks(worker.slot)], now_s);
                    }
                }
            }
        }
        found
            .into_iter()
            .map(|(wi, hit)| (self.workers[wi].as_ref().expect("placed").id.as_str(), hit))
            .collect()
    }

    // ------------------------------------------------------------------ state

    pub fn totals(&self) -> ApplyStats {
        self.totals
    }

    /// Estimated heap bytes of the index's tables: (mask tables, engine maps and the rest
    /// of the workers' maps, recently removed caches).
    pub fn heap_bytes(&self) -> (usize, usize, usize) {
        let tables = self
            .spaces
            .iter()
            .flat_map(|s| s.words.iter().flatten())
            .map(FlatMap::heap_bytes)
            .sum();
        let (mut maps, mut recent) = (0, 0);
        for w in self.workers.iter().flatten() {
            maps += w.emap.heap_bytes();
            maps += w
                .dups
                .iter()
                .map(|d| crate::flat::table_bytes(d.capacity(), 13))
                .sum::<usize>();
            maps += w.lru.as_ref().map_or(0, |l| l.len() * 48);
            recent += w.recent.heap_bytes();
        }
        (tables, maps, recent)
    }

    /// Per data-parallel rank, the seq of the last batch applied (to resume ingest).
    pub fn last_seq(&self, worker_id: &str) -> Vec<(i64, i64)> {
        self.worker(worker_id)
            .map(|w| w.last_seq.iter().map(|(&r, &s)| (r, s)).collect())
            .unwrap_or_default()
    }

    /// Worker ids in registration order.
    pub fn worker_ids(&self) -> Vec<String> {
        self.order
            .iter()
            .map(|&wi| self.workers[wi].as_ref().expect("registered").id.clone())
            .collect()
    }

    /// Workers in registration order.
    pub fn worker_stats(&self) -> Vec<WorkerStats> {
        self.order
            .iter()
            .map(|&wi| {
                let w = self.workers[wi].as_ref().expect("registered");
                WorkerStats {
                    worker_id: w.id.clone(),
                    model: w.model.clone(),
                    block_size: w.block_size,
                    eagle: w.eagle,
                    store_only: w.store_only(),
                    approximate: w.approximate,
                    resets: w.resets,
                    last_reset_reason: w.reset_reason.clone(),
                    last_seq: w.last_seq.iter().map(|(&r, &s)| (r, s)).collect(),
                    blocks: w.counts,
                    engine_hashes: w.emap.len(),
                    duplicate_copies: w
                        .dups
                        .iter()
                        .flat_map(|d| d.values())
                        .map(|&n| u64::from(n))
                        .sum(),
                    recently_removed: w.recent.len(),
                    recent_capacity: w.recent.capacity(),
                    peak_engine_hashes: w.peak,
                }
            })
            .collect()
    }

    /// Spaces in creation order.
    pub fn space_stats(&self) -> Vec<SpaceStats> {
        self.spaces
            .iter()
            .map(|s| SpaceStats {
                model: s.model.clone(),
                block_size: s.block_size,
                workers: s.workers().count(),
                entries: s.entries(),
            })
            .collect()
    }

    /// The tier names, fastest first.
    pub fn tiers() -> [&'static str; 4] {
        TIERS
    }
}
