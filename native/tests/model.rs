//! The index against a brute-force model, on long seeded random walks.
//!
//! The model is the plain reading of the spec: per worker a map engine hash → prefix (all
//! tokens from the start of the chain), a map (prefix, tier) → physical copies, and the
//! recently removed engine hashes (engine hash → prefix; the walks stay far below the
//! index's bound); a lookup walks each worker's prefixes one by one. It never hashes
//! anything, so it checks the index's own content hash as well as its bookkeeping.

mod common;

use std::collections::{BTreeMap, HashMap};

use common::*;
use foretoken_native::snapshot::{restore, snapshot};
use foretoken_native::{Index, RecentPolicy, TIERS};
use xxhash_rust::xxh3::xxh3_64;

type Prefix = Vec<u32>;

/// Blocks of BS tokens, unique per (document, position) except where documents share a
/// prefix: D1 shares 2 blocks with D0, D2 shares 4.
fn docs() -> Vec<Vec<[u32; 2]>> {
    let run = |base: u32, from: u32, n: u32| {
        (from..from + n).map(move |i| [base + 2 * i, base + 2 * i + 1])
    };
    vec![
        run(100, 0, 6).collect(),
        run(100, 0, 2).chain(run(300, 2, 4)).collect(),
        run(100, 0, 4).chain(run(500, 4, 2)).collect(),
        run(700, 0, 6).collect(),
    ]
}

const WORKERS: [(&str, u64, bool); 3] = [("a", 0, false), ("b", 1, true), ("c", 0, false)];

fn engine_hash(seed: u64, doc: &[[u32; 2]], block: usize) -> u64 {
    let mut data = seed.to_le_bytes().to_vec();
    for b in &doc[..=block] {
        for t in b {
            data.extend_from_slice(&t.to_le_bytes());
        }
    }
    xxh3_64(&data)
}

#[derive(Default, Clone)]
struct ModelWorker {
    emap: HashMap<u64, Prefix>,
    copies: HashMap<(Prefix, usize), u32>,
    recent: HashMap<u64, Prefix>,
    approximate: bool,
}

impl ModelWorker {
    fn holds(&self, prefix: &Prefix) -> bool {
        (0..4).any(|t| {
            self.copies
                .get(&(prefix.clone(), t))
                .is_some_and(|&n| n > 0)
        })
    }

    fn resolve(&self, h: u64) -> Option<Prefix> {
        self.emap.get(&h).or_else(|| self.recent.get(&h)).cloned()
    }

    fn drop_engine(&mut self, h: u64) {
        if let Some(p) = self.emap.remove(&h) {
            self.recent.insert(h, p);
        }
    }

    fn store(&mut self, ev: &Ev) {
        if ev.tokens.is_empty() {
            for &h in &ev.hashes {
                if let Some(p) = self.resolve(h) {
                    *self.copies.entry((p.clone(), ev.tier)).or_insert(0) += 1;
                    self.emap.insert(h, p);
                }
            }
            return;
        }
        let mut prefix = ev.parent.and_then(|p| self.resolve(p)).unwrap_or_default();
        for (i, &h) in ev.hashes.iter().enumerate() {
            prefix.extend_from_slice(&ev.tokens[i * 2..(i + 1) * 2]);
            if let Some(old) = self.emap.get(&h).cloned() {
                if old != prefix {
                    for t in 0..4 {
                        self.copies.remove(&(old.clone(), t));
                    }
                }
            }
            self.emap.insert(h, prefix.clone());
            *self.copies.entry((prefix.clone(), ev.tier)).or_insert(0) += 1;
        }
    }

    fn remove(&mut self, ev: &Ev) {
        for &h in &ev.hashes {
            let Some(prefix) = self.emap.get(&h).cloned() else {
                continue;
            };
            let key = (prefix.clone(), ev.tier);
            match self.copies.get_mut(&key) {
                Some(n) if *n > 0 => {
                    *n -= 1;
                    if *n == 0 {
                        self.copies.remove(&key);
                    }
                }
                _ => continue,
            }
            if !self.holds(&prefix) {
                self.drop_engine(h);
            }
        }
    }

    fn clear(&mut self, tier: Option<usize>) {
        self.copies
            .retain(|(_, t), _| tier.is_some_and(|c| c != *t));
        if tier.is_none() {
            self.emap.clear();
            self.recent.clear();
            return;
        }
        let gone: Vec<u64> = self
            .emap
            .iter()
            .filter(|(_, p)| !self.holds(p))
            .map(|(&h, _)| h)
            .collect();
        for h in gone {
            self.drop_engine(h);
        }
    }

    fn hit(&self, prompt: &[u32], eagle: bool) -> BTreeMap<&'static str, u64> {
        let mut best = Vec::new();
        for k in 0..prompt.len() / 2 {
            let prefix = prompt[..(k + 1) * 2].to_vec();
            let held = (0..4).find(|&t| {
                self.copies
                    .get(&(prefix.clone(), t))
                    .is_some_and(|&n| n > 0)
            });
            match held {
                Some(t) => best.push(t),
                None => break,
            }
        }
        if eagle {
            best.pop();
        }
        let mut out = BTreeMap::new();
        for t in best {
            *out.entry(TIERS[t]).or_insert(0) += 2;
        }
        out
    }
}

#[derive(Clone, Debug)]
enum Op {
    Store {
        w: usize,
        doc: usize,
        start: usize,
        len: usize,
        tier: usize,
        parent: bool,
    },
    Remove {
        w: usize,
        ranks: Vec<i64>,
        medium: usize,
    },
    Move {
        w: usize,
        ranks: Vec<i64>,
        tier: usize,
    },
    Clear {
        w: usize,
        tier: Option<usize>,
    },
    Reset {
        w: usize,
    },
}

fn random_op(rng: &mut Rng) -> Op {
    let w = rng.below(3);
    let ranks: Vec<i64> = (0..rng.range(1, 3))
        .map(|_| rng.range(0, 52) as i64 - 1)
        .collect();
    if rng.chance(0.04) {
        return if rng.chance(0.5) {
            Op::Clear {
                w,
                tier: [None, Some(0), Some(1), Some(2)][rng.below(4)],
            }
        } else {
            Op::Reset { w }
        };
    }
    match rng.below(13) {
        0..=5 => Op::Store {
            w,
            doc: rng.below(4),
            start: rng.below(6),
            len: rng.range(1, 6),
            tier: *rng.pick(&[0, 0, 0, 1, 2]),
            parent: rng.below(3) < 2,
        },
        6..=10 => Op::Remove {
            w,
            ranks,
            medium: *rng.pick(&[0, 0, 0, 1, 2, 3]),
        },
        _ => Op::Move {
            w,
            ranks,
            tier: rng.below(3),
        },
    }
}

/// Known engine hashes by rank; ranks 41.. pick recently removed ones, -1 an unknown one.
fn picked(model: &ModelWorker, ranks: &[i64]) -> Vec<u64> {
    let mut known: Vec<u64> = model.emap.keys().copied().collect();
    known.sort_unstable();
    let mut gone: Vec<u64> = model.recent.keys().copied().collect();
    gone.sort_unstable();
    ranks
        .iter()
        .map(|&r| {
            if r >= 41 && !gone.is_empty() {
                gone[r as usize % gone.len()]
            } else if r >= 0 && !known.is_empty() {
                known[r as usize % known.len()]
            } else {
                (12_345 + r) as u64
            }
        })
        .collect()
}

fn to_event(op: &Op, fleet: &[ModelWorker], docs: &[Vec<[u32; 2]>]) -> (usize, Ev) {
    match op {
        Op::Store {
            w,
            doc,
            start,
            len,
            tier,
            parent,
        } => {
            let seed = WORKERS[*w].1;
            let d = &docs[*doc];
            let stop = (start + len).min(6);
            let hashes: Vec<u64> = (*start..stop).map(|b| engine_hash(seed, d, b)).collect();
            let tokens: Vec<u32> = d[*start..stop].iter().flatten().copied().collect();
            let parent = (*parent && *start > 0).then(|| engine_hash(seed, d, start - 1));
            (*w, stored(&hashes, &tokens).parent_opt(parent).tier(*tier))
        }
        Op::Move { w, ranks, tier } => (*w, moved(&picked(&fleet[*w], ranks), TIERS[*tier])),
        Op::Remove { w, ranks, medium } => {
            let model = &fleet[*w];
            let hashes = picked(model, ranks);
            let held = model
                .emap
                .get(&hashes[0])
                .and_then(|p| (0..4).find(|&t| model.copies.contains_key(&(p.clone(), t))));
            let tier = if *medium > 0 {
                medium - 1
            } else {
                held.unwrap_or(0)
            };
            (*w, removed(&hashes).tier(tier))
        }
        Op::Clear { w, tier } => (*w, cleared(tier.map(|t| TIERS[t]))),
        Op::Reset { w } => (*w, reset("test")),
    }
}

fn check_equal(index: &mut Index, fleet: &[ModelWorker], docs: &[Vec<[u32; 2]>], context: &str) {
    for doc in docs {
        let prompt: Vec<u32> = doc.iter().flatten().copied().collect();
        for length in [prompt.len(), 7, 3] {
            let hits = lookup(index, &prompt[..length]);
            for (i, (name, _, eagle)) in WORKERS.iter().enumerate() {
                let hit = &hits[*name];
                assert_eq!(
                    tokens_of(hit),
                    fleet[i].hit(&prompt[..length], *eagle),
                    "{context}: worker {name}, prompt {:?}",
                    &prompt[..length]
                );
                assert_eq!(hit.approximate, fleet[i].approximate, "{context}");
            }
        }
    }
    for (i, (name, _, _)) in WORKERS.iter().enumerate() {
        let got = blocks(index, name);
        for (t, n) in got.iter().enumerate() {
            let expected = fleet[i]
                .copies
                .keys()
                .filter(|(_, tier)| *tier == t)
                .count() as i64;
            assert_eq!(*n, expected, "{context}: worker {name} tier {}", TIERS[t]);
        }
    }
}

fn run_against_model(ops: &[Op], fillers: usize, label: &str) {
    let mut index = Index::new(b"salt", RecentPolicy::default());
    for (i, (name, _, eagle)) in WORKERS.iter().enumerate() {
        if i == 2 {
            for f in 0..fillers {
                index
                    .register_worker(&format!("filler{f}"), M, BS, false, None, None)
                    .unwrap();
            }
        }
        index
            .register_worker(name, M, BS, *eagle, None, None)
            .unwrap();
    }
    let docs = docs();
    let mut fleet = vec![ModelWorker::default(); 3];
    for (seq, op) in ops.iter().enumerate() {
        let (w, ev) = to_event(op, &fleet, &docs);
        apply_at(
            &mut index,
            WORKERS[w].0,
            std::slice::from_ref(&ev),
            seq as i64,
            seq as f64,
        );
        let model = &mut fleet[w];
        match &ev.kind {
            Kind::Stored => model.store(&ev),
            Kind::Removed => model.remove(&ev),
            Kind::Cleared(tier) => {
                model.clear(*tier);
                if tier.is_none() {
                    model.approximate = false;
                }
            }
            Kind::Reset(_) => {
                model.clear(None);
                model.approximate = true;
            }
        }
        check_equal(
            &mut index,
            &fleet,
            &docs,
            &format!("{label} op {seq} {op:?}"),
        );
    }
    let data = snapshot(&index);
    let mut copy = restore(&data).expect("restores");
    assert_eq!(snapshot(&copy), data);
    check_equal(&mut copy, &fleet, &docs, &format!("{label} restored"));
}

#[test]
fn short_random_walks_agree_with_the_model() {
    for seed in 1..=400u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let ops: Vec<Op> = (0..rng.range(5, 50)).map(|_| random_op(&mut rng)).collect();
        let fillers = if seed % 3 == 0 { 62 } else { 0 }; // worker c in the second word
        run_against_model(&ops, fillers, &format!("seed {seed}"));
    }
}

#[test]
fn long_random_walks_agree_with_the_model() {
    for seed in 0..6u64 {
        let mut rng = Rng(0xdead_beef + seed);
        let ops: Vec<Op> = (0..600).map(|_| random_op(&mut rng)).collect();
        run_against_model(
            &ops,
            if seed % 2 == 0 { 0 } else { 62 },
            &format!("long {seed}"),
        );
    }
}
