//! Helpers of the Rust tests: owned events, batches, lookups.
#![allow(dead_code)]

use std::collections::BTreeMap;

use foretoken_native::hash::{key_mixes, Tokens};
use foretoken_native::space::tier_index;
use foretoken_native::{ApplyStats, Event, Hit, Index, RecentPolicy, Stored, TIERS};

pub const M: &str = "m";
pub const BS: i64 = 2;

#[derive(Clone, Debug)]
pub enum Kind {
    Stored,
    Removed,
    Cleared(Option<usize>),
    Reset(String),
}

/// An event that owns its data (`as_event` borrows it for `Index::apply`).
#[derive(Clone, Debug)]
pub struct Ev {
    pub kind: Kind,
    pub hashes: Vec<u64>,
    pub parent: Option<u64>,
    pub tokens: Vec<u32>,
    pub block_size: i64,
    pub lora: Option<String>,
    pub tier: usize,
    pub group: i64,
    pub full: bool,
    pub mixes: Vec<Option<u64>>,
}

impl Ev {
    fn base(kind: Kind, hashes: &[u64]) -> Self {
        Self {
            kind,
            hashes: hashes.to_vec(),
            parent: None,
            tokens: Vec::new(),
            block_size: BS,
            lora: None,
            tier: 0,
            group: 0,
            full: true,
            mixes: Vec::new(),
        }
    }
    pub fn parent(mut self, p: u64) -> Self {
        self.parent = Some(p);
        self
    }
    pub fn parent_opt(mut self, p: Option<u64>) -> Self {
        self.parent = p;
        self
    }
    pub fn medium(mut self, m: &str) -> Self {
        self.tier = tier_index(m).expect("tier");
        self
    }
    pub fn tier(mut self, t: usize) -> Self {
        self.tier = t;
        self
    }
    pub fn group(mut self, g: i64) -> Self {
        self.group = g;
        self
    }
    pub fn nonfull(mut self) -> Self {
        self.full = false;
        self
    }
    pub fn block_size(mut self, b: i64) -> Self {
        self.block_size = b;
        self
    }
    pub fn lora(mut self, l: &str) -> Self {
        self.lora = Some(l.to_owned());
        self
    }
    pub fn keys(mut self, keys: &[&str]) -> Self {
        self.mixes = key_mixes(keys);
        self
    }

    pub fn as_event(&self) -> Event<'_> {
        match &self.kind {
            Kind::Stored => Event::Stored(Stored {
                hashes: &self.hashes,
                parent: self.parent,
                tokens: Tokens::Ids(&self.tokens),
                block_size: self.block_size,
                lora_name: self.lora.as_deref(),
                tier: self.tier,
                group_idx: self.group,
                full_attention: self.full,
                extra_keys: &self.mixes,
            }),
            Kind::Removed => Event::Removed {
                hashes: &self.hashes,
                tier: self.tier,
                group_idx: self.group,
            },
            Kind::Cleared(tier) => Event::Cleared { tier: *tier },
            Kind::Reset(reason) => Event::Reset {
                reason,
                approximate: true,
            },
        }
    }
}

pub fn stored(hashes: &[u64], tokens: &[u32]) -> Ev {
    let mut ev = Ev::base(Kind::Stored, hashes);
    ev.tokens = tokens.to_vec();
    ev
}

/// A store without token ids: a move or copy of known blocks to another tier.
pub fn moved(hashes: &[u64], medium: &str) -> Ev {
    Ev::base(Kind::Stored, hashes).medium(medium)
}

pub fn removed(hashes: &[u64]) -> Ev {
    Ev::base(Kind::Removed, hashes)
}

pub fn cleared(medium: Option<&str>) -> Ev {
    Ev::base(
        Kind::Cleared(medium.map(|m| tier_index(m).expect("tier"))),
        &[],
    )
}

pub fn reset(reason: &str) -> Ev {
    Ev::base(Kind::Reset(reason.to_owned()), &[])
}

pub fn toks(blocks: usize, start: u32) -> Vec<u32> {
    toks_sized(blocks, start, BS as usize)
}

pub fn toks_sized(blocks: usize, start: u32, size: usize) -> Vec<u32> {
    (start..start + (blocks * size) as u32).collect()
}

pub fn fresh(workers: &[&str]) -> Index {
    let mut index = Index::new(b"", RecentPolicy::default());
    for w in workers {
        index
            .register_worker(w, M, BS, false, None, None)
            .expect("register");
    }
    index
}

pub fn apply(index: &mut Index, worker: &str, events: &[Ev]) -> ApplyStats {
    apply_at(index, worker, events, 0, 0.0)
}

pub fn apply_at(
    index: &mut Index,
    worker: &str,
    events: &[Ev],
    seq: i64,
    now_s: f64,
) -> ApplyStats {
    let evs: Vec<Event<'_>> = events.iter().map(Ev::as_event).collect();
    index.apply(worker, M, seq, 0, &evs, now_s)
}

pub fn lookup(index: &mut Index, tokens: &[u32]) -> BTreeMap<String, Hit> {
    lookup_with(index, tokens, None, &[], None)
}

pub fn lookup_with(
    index: &mut Index,
    tokens: &[u32],
    lora: Option<&str>,
    keys: &[&str],
    now_s: Option<f64>,
) -> BTreeMap<String, Hit> {
    let mixes = key_mixes(keys);
    index
        .lookup(M, Some(Tokens::Ids(tokens)), &[], lora, &mixes, now_s)
        .into_iter()
        .map(|(w, h)| (w.to_owned(), h))
        .collect()
}

/// An exact hit of `tokens` tokens, `gpu` of them on the GPU.
pub fn hit(block_size: u32, tokens: u64, gpu: u64) -> Hit {
    Hit {
        block_size,
        tokens,
        tiers: [gpu, 0, 0, 0],
        approximate: false,
    }
}

pub fn tokens_of(hit: &Hit) -> BTreeMap<&'static str, u64> {
    TIERS
        .iter()
        .zip(hit.tiers)
        .filter(|(_, n)| *n > 0)
        .map(|(t, n)| (*t, n))
        .collect()
}

pub fn blocks(index: &Index, worker: &str) -> [i64; 4] {
    index
        .worker_stats()
        .into_iter()
        .find(|w| w.worker_id == worker)
        .expect("worker")
        .blocks
}

pub fn engine_hashes(index: &Index, worker: &str) -> usize {
    index
        .worker_stats()
        .into_iter()
        .find(|w| w.worker_id == worker)
        .expect("worker")
        .engine_hashes
}

/// A tiny deterministic PRNG (xorshift64*), so the randomized tests need no crate.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}
