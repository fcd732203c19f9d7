//! The index core alone (no Python), on the ingest workload of `bench_native.py`:
//! `cargo run --release --example ingest_core -- [entries]` (rates per CPU-second of the
//! thread; `WARM=n` more untimed rounds first, `RECENT=off` without the cross-tier rule).
//! For working on the core's data structures; the figures to quote come from
//! `foretoken bench index` (binding included).

use std::collections::VecDeque;
use std::time::Instant;

use foretoken_native::hash::Tokens;
use foretoken_native::{Event, Index, RecentPolicy, Stored};

/// CPU seconds of this thread (the machine is shared: wall time says little).
fn cpu_s() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    stat.split_whitespace()
        .next()
        .and_then(|ns| ns.parse::<f64>().ok())
        .map_or(0.0, |ns| ns / 1e9)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

struct Owned {
    stored: Vec<(Vec<u64>, Option<u64>, Vec<u8>)>,
    removed: Vec<u64>,
}

struct Engine {
    resident: VecDeque<u64>,
    tails: Vec<u64>,
    capacity: usize,
}

fn batch(e: &mut Engine, rng: &mut Rng, pool: &[Vec<u8>]) -> Owned {
    let mut stored = Vec::new();
    for _ in 0..rng.range(1, 3) {
        let n = rng.range(16, 64) as usize;
        let parent = if !e.tails.is_empty() && rng.next() % 10 < 7 {
            let i = (rng.next() % e.tails.len() as u64) as usize;
            Some(e.tails.swap_remove(i))
        } else {
            None
        };
        let mut tokens = Vec::with_capacity(n * 64);
        let hashes: Vec<u64> = (0..n).map(|_| rng.next()).collect();
        for _ in 0..n {
            tokens.extend_from_slice(&pool[(rng.next() % pool.len() as u64) as usize]);
        }
        e.resident.extend(&hashes);
        e.tails.push(*hashes.last().unwrap());
        if e.tails.len() > 8 {
            e.tails.remove(0);
        }
        stored.push((hashes, parent, tokens));
    }
    let excess = e.resident.len().saturating_sub(e.capacity);
    let removed = e.resident.drain(..excess).collect();
    Owned { stored, removed }
}

fn apply(index: &mut Index, worker: &str, b: &Owned) -> u64 {
    let mut events: Vec<Event<'_>> = b
        .stored
        .iter()
        .map(|(h, p, t)| {
            Event::Stored(Stored {
                hashes: h,
                parent: *p,
                tokens: Tokens::Packed(t),
                block_size: 16,
                lora_name: None,
                tier: 0,
                group_idx: 0,
                full_attention: true,
                extra_keys: &[],
            })
        })
        .collect();
    if !b.removed.is_empty() {
        events.push(Event::Removed {
            hashes: &b.removed,
            tier: 0,
            group_idx: 0,
        });
    }
    index.apply(worker, "m", 0, 0, &events, 0.0).stored_blocks
}

fn main() {
    let entries: usize = std::env::args()
        .nth(1)
        .map_or(1_000_000, |a| a.parse().unwrap());
    let workers = 16;
    let mut rng = Rng(0x1234_5678);
    let pool: Vec<Vec<u8>> = (0..4096)
        .map(|_| {
            (0..16)
                .flat_map(|_| ((rng.next() % 150_000) as u32).to_le_bytes())
                .collect()
        })
        .collect();
    let policy = match std::env::var("RECENT").as_deref() {
        Ok("off") => RecentPolicy {
            min_blocks: 0,
            peak_factor: 0.0,
        },
        _ => RecentPolicy::default(),
    };
    let mut index = Index::new(b"", policy);
    let names: Vec<String> = (0..workers).map(|i| format!("w{i}")).collect();
    for n in &names {
        index
            .register_worker(n, "m", 16, false, None, None)
            .unwrap();
    }
    let mut engines: Vec<Engine> = (0..workers)
        .map(|_| Engine {
            resident: VecDeque::new(),
            tails: Vec::new(),
            capacity: entries / workers,
        })
        .collect();
    let mut run = |index: &mut Index, rounds: usize| -> (u64, f64) {
        let batches: Vec<(usize, Owned)> = (0..rounds)
            .flat_map(|_| (0..workers).collect::<Vec<_>>())
            .map(|w| (w, batch(&mut engines[w], &mut rng, &pool)))
            .collect();
        let (t0, c0) = (Instant::now(), cpu_s());
        let stored: u64 = batches
            .iter()
            .map(|(w, b)| apply(index, &names[*w], b))
            .sum();
        let cpu = cpu_s() - c0;
        (
            stored,
            if cpu > 0.0 {
                cpu
            } else {
                t0.elapsed().as_secs_f64()
            },
        )
    };
    let (mut fill_blocks, mut fill_s) = (0, 0.0);
    while (fill_blocks as usize) < entries {
        let (n, s) = run(&mut index, 100);
        fill_blocks += n;
        fill_s += s;
    }
    let warm: usize = std::env::var("WARM").ok().map_or(0, |v| v.parse().unwrap());
    for _ in 0..warm {
        run(&mut index, 100);
    }
    let mut rates = Vec::new();
    for _ in 0..5 {
        let (n, s) = run(&mut index, 100);
        rates.push(n as f64 / s);
    }
    rates.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "entries {entries}: fill {:.0} stored blocks/s, steady {:.0} (segments {:?})",
        fill_blocks as f64 / fill_s,
        rates[2],
        rates
            .iter()
            .map(|r| (*r / 1000.0).round() as u64)
            .collect::<Vec<_>>()
    );
}
