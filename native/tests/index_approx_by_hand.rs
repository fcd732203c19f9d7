//! The index's approximate mode by hand (store-only workers credited with the prompts
//! served to them): the index part of the Python reference's
//! tests/unit/core/index/test_approx.py, ported.

mod common;

use common::*;
use foretoken_native::hash::Tokens;
use foretoken_native::snapshot::{restore, snapshot};
use foretoken_native::{Index, RecentPolicy};

fn approx(capacity: Option<i64>, ttl: Option<f64>) -> Index {
    let mut index = Index::new(b"", RecentPolicy::default());
    index
        .register_worker("a", M, 16, false, ttl, capacity)
        .unwrap();
    index
        .register_worker("e", M, 16, false, None, None)
        .unwrap();
    index
}

fn prompt16(blocks: usize, start: u32) -> Vec<u32> {
    toks_sized(blocks, start, 16)
}

fn serve(index: &mut Index, worker: &str, tokens: &[u32], now_s: f64) -> usize {
    let owns = index.hash_prompt(M, 16, Tokens::Ids(tokens), None, &[]);
    index.observe_served(worker, &owns, now_s)
}

#[test]
fn a_served_prompt_is_credited_on_its_worker_only() {
    let mut index = approx(None, Some(60.0));
    let p = prompt16(4, 0);
    assert_eq!(serve(&mut index, "a", &p, 0.0), 4);
    assert_eq!(serve(&mut index, "e", &p, 0.0), 0); // a worker with events does not learn
    let hits = lookup(&mut index, &p);
    assert!(hits["a"].tokens == 64 && hits["a"].approximate);
    assert!(hits["e"].tokens == 0 && !hits["e"].approximate);
    let mut longer = p[..32].to_vec();
    longer.extend(prompt16(2, 5000));
    assert_eq!(lookup(&mut index, &longer)["a"].tokens, 32);
    assert_eq!(serve(&mut index, "a", &p, 1.0), 0); // refreshes, no copies
    let a = &index.worker_stats()[0];
    assert_eq!((a.blocks[0], a.duplicate_copies), (4, 0));
}

#[test]
fn aging_forgets_a_prompt_a_ttl_after_it_was_last_served() {
    let ttl = 60.0;
    let mut index = approx(None, Some(ttl));
    let (old, new) = (prompt16(3, 0), prompt16(3, 7000));
    serve(&mut index, "a", &old, 0.0);
    serve(&mut index, "a", &new, ttl / 2.0);
    index.age(ttl * 0.99);
    assert_eq!(lookup(&mut index, &old)["a"].tokens, 48);
    index.age(ttl * (1.0 + 1.0 / 8.0) + 0.01);
    assert_eq!(lookup(&mut index, &old)["a"].tokens, 0);
    assert_eq!(lookup(&mut index, &new)["a"].tokens, 48);
    assert_eq!(index.totals().expired_blocks, 3);
    serve(&mut index, "a", &new, 1.2 * ttl);
    index.age(2.0 * ttl);
    assert_eq!(lookup(&mut index, &new)["a"].tokens, 48);
    index.age(2.2 * ttl + ttl / 8.0 + 0.01);
    assert_eq!(lookup(&mut index, &new)["a"].tokens, 0);
    assert_eq!(engine_hashes(&index, "a"), 0);
}

#[test]
fn capacity_evicts_the_least_recently_served_at_the_estimate() {
    let mut index = approx(Some(8), Some(600.0));
    let (first, second, third) = (prompt16(3, 0), prompt16(3, 1000), prompt16(3, 2000));
    serve(&mut index, "a", &first, 0.0);
    serve(&mut index, "a", &second, 1.0);
    serve(&mut index, "a", &first, 2.0);
    serve(&mut index, "a", &third, 3.0); // 9 blocks > 8: one block of `second` goes
    assert_eq!(blocks(&index, "a")[0], 8);
    let got: Vec<u64> = [&first, &second, &third]
        .iter()
        .map(|p| lookup(&mut index, p)["a"].tokens)
        .collect();
    assert_eq!(got, vec![48, 32, 48]); // the tail of the least recent prompt went first
    serve(&mut index, "a", &prompt16(5, 3000), 4.0);
    let got: Vec<u64> = [&first, &second, &third]
        .iter()
        .map(|p| lookup(&mut index, p)["a"].tokens)
        .collect();
    assert_eq!(got, vec![0, 0, 48]);
    assert_eq!(index.totals().trimmed_blocks, 6);
}

#[test]
fn a_prompt_larger_than_the_capacity_keeps_its_prefix() {
    let mut index = approx(Some(4), Some(300.0));
    let p = prompt16(6, 0);
    serve(&mut index, "a", &p, 0.0);
    assert_eq!(lookup(&mut index, &p)["a"].tokens, 64);
}

#[test]
fn the_approximate_view_survives_a_snapshot() {
    let mut index = approx(Some(8), Some(60.0));
    serve(&mut index, "a", &prompt16(3, 0), 0.0);
    let mut copy = restore(&snapshot(&index)).unwrap();
    assert_eq!(lookup(&mut copy, &prompt16(3, 0))["a"].tokens, 48);
    copy.age(90.0);
    assert_eq!(lookup(&mut copy, &prompt16(3, 0))["a"].tokens, 0);
}

#[test]
fn counters_stay_exact_over_many_served_prompts() {
    let mut index = approx(Some(100_000), Some(60.0));
    let served = 1124;
    for i in 0..served {
        serve(
            &mut index,
            "a",
            &prompt16(1, 160 * i as u32),
            i as f64 * 1e-3,
        );
    }
    assert_eq!(index.totals().stored_blocks, served);
    assert_eq!(blocks(&index, "a")[0], served as i64);
}

#[test]
fn capacity_lru_matches_a_reference_model() {
    // Without expiry the approximate view is an LRU of blocks at the capacity, refreshed by
    // each served prompt, a prompt's tail older than its prefix.
    let mut rng = Rng(0x5eed);
    for _case in 0..60 {
        let capacity = rng.range(1, 12);
        let mut index = approx(Some(capacity as i64), Some(1e9));
        let mut lru: Vec<u64> = Vec::new(); // oldest first
        let mut prompts: Vec<Vec<u32>> = Vec::new();
        for t in 0..rng.range(1, 25) {
            let (family, shared, extra, suffix) =
                (rng.below(3), rng.below(5), rng.below(4), rng.below(6));
            let mut p: Vec<u32> = (0..(shared * 16) as u32)
                .map(|x| family as u32 * 1000 + x)
                .collect();
            p.extend((0..(extra * 16) as u32).map(|x| 100_000 + suffix as u32 * 1000 + x));
            let owns = index.hash_prompt(M, 16, Tokens::Ids(&p), None, &[]);
            index.observe_served("a", &owns, t as f64);
            for own in owns.iter().rev() {
                lru.retain(|o| o != own);
                lru.push(*own);
            }
            while lru.len() > capacity {
                lru.remove(0);
            }
            prompts.push(p);
            assert_eq!(blocks(&index, "a")[0], lru.len() as i64);
            for other in &prompts {
                let hashes = index.hash_prompt(M, 16, Tokens::Ids(other), None, &[]);
                let expected = hashes.iter().take_while(|h| lru.contains(h)).count() as u64;
                assert_eq!(lookup(&mut index, other)["a"].tokens, expected * 16);
            }
        }
    }
}
