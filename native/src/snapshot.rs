//! The index's state as bytes, and back.
//!
//! Layout (all integers little-endian): the magic `FTKNIDX\0`, the format version (u32),
//! the hash spec version (u32), then the body, then xxh3_64 of everything before it (u64).
//! Tables and maps are written sorted, so equal indexes give equal snapshots.
//!
//! Body: salt; recent policy; totals; spaces (model, block size, slot
//! count, per word and tier the (own, mask) pairs); workers in registration order (every
//! field, the LRU in its order, the recently removed blocks' sets as they are).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use xxhash_rust::xxh3::xxh3_64;

use crate::flat::FlatMap;
use crate::hash::HASH_SPEC;
use crate::index::Index;
use crate::lru::Lru;
use crate::recent::{Recent, Set, WAYS};
use crate::space::{Space, TierSet, TIERS};
use crate::stats::ApplyStats;
use crate::worker::{RecentPolicy, Worker};

pub const MAGIC: &[u8; 8] = b"FTKNIDX\0";
/// 2: the cross-tier counters are part of the totals.
pub const SNAPSHOT_VERSION: u32 = 2;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SnapshotError {
    /// Not a native index snapshot (e.g. the Python reference's msgpack snapshot).
    Foreign,
    Version(u32),
    HashSpec(u32),
    Corrupt(String),
}

impl fmt::Display for SnapshotError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SnapshotError::Foreign => write!(
                f,
                "not a foretoken native index snapshot (no FTKNIDX header; \
                 a Python PrefixIndex snapshot cannot be restored natively)"
            ),
            SnapshotError::Version(v) => write!(
                f,
                "snapshot format version {v}, this build reads {SNAPSHOT_VERSION}"
            ),
            SnapshotError::HashSpec(v) => write!(
                f,
                "snapshot hashed with content hash spec v{v}, this build hashes with v{HASH_SPEC}"
            ),
            SnapshotError::Corrupt(why) => write!(f, "corrupt native index snapshot: {why}"),
        }
    }
}

impl std::error::Error for SnapshotError {}

// --------------------------------------------------------------------------- writer

#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn f64(&mut self, v: f64) {
        self.0.extend_from_slice(&v.to_bits().to_le_bytes());
    }
    fn len(&mut self, n: usize) {
        self.u64(n as u64);
    }
    fn bytes(&mut self, b: &[u8]) {
        self.len(b.len());
        self.0.extend_from_slice(b);
    }
    fn str(&mut self, s: &str) {
        self.bytes(s.as_bytes());
    }
    fn opt_str(&mut self, s: Option<&str>) {
        match s {
            None => self.u8(0),
            Some(s) => {
                self.u8(1);
                self.str(s);
            }
        }
    }
    fn opt_f64(&mut self, v: Option<f64>) {
        match v {
            None => self.u8(0),
            Some(v) => {
                self.u8(1);
                self.f64(v);
            }
        }
    }
    fn opt_u64(&mut self, v: Option<u64>) {
        match v {
            None => self.u8(0),
            Some(v) => {
                self.u8(1);
                self.u64(v);
            }
        }
    }
    fn pairs(&mut self, map: &FlatMap) {
        let mut pairs: Vec<(u64, u64)> = map.iter().collect();
        pairs.sort_unstable();
        self.len(pairs.len());
        self.0.reserve(pairs.len() * 16);
        for (k, v) in pairs {
            self.u64(k);
            self.u64(v);
        }
    }
}

pub fn snapshot(index: &Index) -> Vec<u8> {
    let mut w = Writer::default();
    w.0.extend_from_slice(MAGIC);
    w.u32(SNAPSHOT_VERSION);
    w.u32(HASH_SPEC);
    w.bytes(&index.salt);
    w.u64(index.policy.min_blocks);
    w.f64(index.policy.peak_factor);
    let totals = index.totals.values();
    w.len(totals.len());
    totals.into_iter().for_each(|v| w.u64(v));
    w.len(index.spaces.len());
    for space in &index.spaces {
        w.str(&space.model);
        w.u32(space.block_size);
        w.len(space.slots.len());
        w.len(space.words.len());
        for word in &space.words {
            for table in word {
                w.pairs(table);
            }
        }
    }
    w.len(index.order.len());
    for &wi in &index.order {
        write_worker(&mut w, index.workers[wi].as_ref().expect("registered"));
    }
    let digest = xxh3_64(&w.0);
    w.u64(digest);
    w.0
}

fn write_worker(w: &mut Writer, worker: &Worker) {
    w.str(&worker.id);
    w.str(&worker.model);
    w.u32(worker.block_size);
    w.len(worker.slot);
    w.u8(u8::from(worker.eagle));
    w.opt_f64(worker.ttl_s);
    w.opt_u64(worker.capacity);
    w.u8(u8::from(worker.approximate));
    w.u64(worker.resets);
    w.opt_str(worker.reset_reason.as_deref());
    w.len(worker.last_seq.len());
    for (&rank, &seq) in &worker.last_seq {
        w.i64(rank);
        w.i64(seq);
    }
    w.len(worker.nonfull_groups.len());
    for &g in &worker.nonfull_groups {
        w.i64(g);
    }
    w.u8(worker.tiers.0);
    for &c in &worker.counts {
        w.i64(c);
    }
    w.pairs(&worker.emap);
    for dups in &worker.dups {
        let mut pairs: Vec<(u64, u32)> = dups.iter().map(|(&k, &v)| (k, v)).collect();
        pairs.sort_unstable();
        w.len(pairs.len());
        for (own, n) in pairs {
            w.u64(own);
            w.u32(n);
        }
    }
    match &worker.lru {
        None => w.u8(0),
        Some(lru) => {
            w.u8(1);
            w.len(lru.len());
            for (own, engine, last_s) in lru.iter() {
                w.u64(own);
                w.u64(engine);
                w.f64(last_s);
            }
        }
    }
    w.f64(worker.next_sweep_s);
    w.u64(worker.peak);
    w.u64(worker.recent_policy.min_blocks);
    w.f64(worker.recent_policy.peak_factor);
    let sets = worker.recent.sets();
    w.len(sets.len());
    for set in sets {
        for [engine, own] in set.0 {
            w.u64(engine);
            w.u64(own);
        }
    }
}

// --------------------------------------------------------------------------- reader

struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

type Res<T> = Result<T, SnapshotError>;

fn corrupt<T>(why: &str) -> Res<T> {
    Err(SnapshotError::Corrupt(why.to_owned()))
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Res<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.data.len());
        let Some(end) = end else {
            return corrupt("truncated");
        };
        let out = &self.data[self.at..end];
        self.at = end;
        Ok(out)
    }
    fn array<const N: usize>(&mut self) -> Res<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
    fn u8(&mut self) -> Res<u8> {
        Ok(self.take(1)?[0])
    }
    fn bool(&mut self) -> Res<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => corrupt("bad flag"),
        }
    }
    fn u32(&mut self) -> Res<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Res<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn i64(&mut self) -> Res<i64> {
        Ok(i64::from_le_bytes(self.array()?))
    }
    fn f64(&mut self) -> Res<f64> {
        Ok(f64::from_bits(self.u64()?))
    }
    /// A count of items of at least `item` bytes each (bounded by what is left).
    fn len(&mut self, item: usize) -> Res<usize> {
        let n = self.u64()?;
        let left = (self.data.len() - self.at) as u64;
        if n.saturating_mul(item.max(1) as u64) > left {
            return corrupt("count past the end");
        }
        Ok(n as usize)
    }
    fn bytes(&mut self) -> Res<&'a [u8]> {
        let n = self.len(1)?;
        self.take(n)
    }
    fn str(&mut self) -> Res<String> {
        match std::str::from_utf8(self.bytes()?) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => corrupt("bad UTF-8"),
        }
    }
    fn opt_str(&mut self) -> Res<Option<String>> {
        Ok(if self.bool()? {
            Some(self.str()?)
        } else {
            None
        })
    }
    fn opt_f64(&mut self) -> Res<Option<f64>> {
        Ok(if self.bool()? {
            Some(self.f64()?)
        } else {
            None
        })
    }
    fn opt_u64(&mut self) -> Res<Option<u64>> {
        Ok(if self.bool()? {
            Some(self.u64()?)
        } else {
            None
        })
    }
    fn pairs(&mut self) -> Res<FlatMap> {
        let n = self.len(16)?;
        let mut map = FlatMap::with_capacity(n);
        for _ in 0..n {
            let k = self.u64()?;
            let v = self.u64()?;
            if map.insert(k, v).is_some() {
                return corrupt("duplicate key");
            }
        }
        Ok(map)
    }
}

pub fn restore(data: &[u8]) -> Res<Index> {
    if data.len() < 16 || &data[..8] != MAGIC {
        return Err(SnapshotError::Foreign);
    }
    let mut r = Reader { data, at: 8 };
    let version = r.u32()?;
    if version != SNAPSHOT_VERSION {
        return Err(SnapshotError::Version(version));
    }
    let spec = r.u32()?;
    if spec != HASH_SPEC {
        return Err(SnapshotError::HashSpec(spec));
    }
    if data.len() < 24 {
        return corrupt("truncated");
    }
    let (body, digest) = data.split_at(data.len() - 8);
    if xxh3_64(body) != u64::from_le_bytes(digest.try_into().expect("8 bytes")) {
        return corrupt("checksum mismatch (truncated or altered)");
    }
    let mut r = Reader {
        data: body,
        at: r.at,
    };
    let salt = r.bytes()?.to_vec();
    let policy = RecentPolicy {
        min_blocks: r.u64()?,
        peak_factor: r.f64()?,
    };
    let mut index = Index::new(&salt, policy);
    let n = r.len(8)?;
    let totals: Vec<u64> = (0..n).map(|_| r.u64()).collect::<Res<_>>()?;
    index.totals = match ApplyStats::from_values(&totals) {
        Some(t) => t,
        None => return corrupt("counter count"),
    };
    let spaces = r.len(1)?;
    for si in 0..spaces {
        let model = r.str()?;
        let block_size = r.u32()?;
        let mut space = Space::new(&model, block_size, &salt);
        space.slots = vec![None; r.len(0)?];
        let words = r.len(1)?;
        for word in 0..words {
            space.grow(word * crate::space::WORD_BITS);
            for tier in 0..TIERS.len() {
                space.words[word][tier] = r.pairs()?;
            }
        }
        let key = (model.clone(), block_size);
        if index.space_by_key.insert(key, si).is_some() {
            return corrupt("duplicate space");
        }
        index.models.entry(model).or_default().push(si);
        index.spaces.push(space);
    }
    for list in index.models.values_mut() {
        list.sort_by_key(|&s| index.spaces[s].block_size);
    }
    let workers = r.len(1)?;
    for wi in 0..workers {
        let worker = read_worker(&mut r, &index)?;
        let space = &mut index.spaces[worker.space];
        if space.slots.get(worker.slot).is_some_and(Option::is_some) {
            return corrupt("two workers in one slot");
        }
        space.place(worker.slot, wi);
        if index.by_id.insert(worker.id.clone(), wi).is_some() {
            return corrupt("duplicate worker");
        }
        index.order.push(wi);
        index.workers.push(Some(worker));
    }
    if r.at != body.len() {
        return corrupt("trailing bytes");
    }
    Ok(index)
}

fn read_worker(r: &mut Reader<'_>, index: &Index) -> Res<Worker> {
    let id = r.str()?;
    let model = r.str()?;
    let block_size = r.u32()?;
    let Some(&space) = index.space_by_key.get(&(model.clone(), block_size)) else {
        return corrupt("worker of an unknown space");
    };
    let slot = r.u64()? as usize;
    if slot > u32::MAX as usize {
        return corrupt("slot");
    }
    let mut w = Worker::new(&id, &model, space, slot, block_size, index.policy);
    w.eagle = r.bool()?;
    w.ttl_s = r.opt_f64()?;
    w.capacity = r.opt_u64()?;
    w.limit = w
        .capacity
        .map(|c| c + c / crate::worker::CAPACITY_SLACK_DIV);
    w.approximate = r.bool()?;
    w.resets = r.u64()?;
    w.reset_reason = r.opt_str()?;
    let n = r.len(16)?;
    let mut last_seq = BTreeMap::new();
    for _ in 0..n {
        let rank = r.i64()?;
        last_seq.insert(rank, r.i64()?);
    }
    w.last_seq = last_seq;
    let n = r.len(8)?;
    let mut groups = BTreeSet::new();
    for _ in 0..n {
        groups.insert(r.i64()?);
    }
    w.nonfull_groups = groups;
    w.tiers = TierSet(r.u8()?);
    for c in w.counts.iter_mut() {
        *c = r.i64()?;
    }
    w.emap = r.pairs()?;
    w.spans = crate::spans::rebuild(&w.emap);
    for dups in w.dups.iter_mut() {
        let n = r.len(12)?;
        for _ in 0..n {
            let own = r.u64()?;
            dups.insert(own, r.u32()?);
        }
    }
    if r.bool()? {
        let n = r.len(24)?;
        let mut lru = Lru::default();
        for _ in 0..n {
            let own = r.u64()?;
            let engine = r.u64()?;
            let last_s = r.f64()?;
            if lru.contains(own) {
                return corrupt("duplicate LRU entry");
            }
            lru.push_back(own, engine, last_s);
        }
        w.lru = Some(lru);
    }
    w.next_sweep_s = r.f64()?;
    w.peak = r.u64()?;
    w.recent_policy = RecentPolicy {
        min_blocks: r.u64()?,
        peak_factor: r.f64()?,
    };
    let n = r.len(16 * WAYS)?;
    let mut sets = Vec::with_capacity(n);
    for _ in 0..n {
        let mut set = Set::default();
        for pair in set.0.iter_mut() {
            *pair = [r.u64()?, r.u64()?];
        }
        sets.push(set);
    }
    w.recent = Recent::from_sets(sets);
    Ok(w)
}
