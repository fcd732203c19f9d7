//! The cross-tier rule as a property: engines publish a block's store in a slower tier and
//! its removal from the GPU in either order, within one batch or across batches. Whatever
//! the interleaving, the index must end with the same credit as when every slower-tier
//! store came first.

mod common;

use common::*;
use foretoken_native::{Hit, Index, RecentPolicy};

fn engine(doc: u64, block: usize) -> u64 {
    (doc << 32) | (block as u64 + 1)
}

/// Splits `0..n` into consecutive chunks of random sizes.
fn chunks(rng: &mut Rng, n: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < n {
        let stop = (start + rng.range(1, 4)).min(n);
        out.push(start..stop);
        start = stop;
    }
    out
}

struct Case {
    /// The GPU stores (a chain in several events).
    gpu: Vec<Ev>,
    /// Slower-tier events (moves without token ids, or stores with token ids and parents).
    slow: Vec<Ev>,
    /// GPU removals.
    removals: Vec<Ev>,
    prompt: Vec<u32>,
}

fn case(rng: &mut Rng, doc: u64) -> Case {
    let n = rng.range(1, 12);
    let prompt = toks(n, 1000 * doc as u32 + 7);
    let tokens = |r: &std::ops::Range<usize>| prompt[r.start * 2..r.end * 2].to_vec();
    let hashes = |r: &std::ops::Range<usize>| r.clone().map(|b| engine(doc, b)).collect::<Vec<_>>();
    let parent = |r: &std::ops::Range<usize>| (r.start > 0).then(|| engine(doc, r.start - 1));
    let gpu = chunks(rng, n)
        .iter()
        .map(|r| stored(&hashes(r), &tokens(r)).parent_opt(parent(r)))
        .collect();
    let slow_tier = *rng.pick(&["CPU", "CPU", "DISK"]);
    let with_tokens = rng.chance(0.5);
    let slow = chunks(rng, n)
        .iter()
        .map(|r| {
            if with_tokens {
                stored(&hashes(r), &tokens(r))
                    .parent_opt(parent(r))
                    .medium(slow_tier)
            } else {
                moved(&hashes(r), slow_tier)
            }
        })
        .collect();
    // GPU removals of every block, in chunks, in a random order of chunks
    let mut removal_chunks = chunks(rng, n);
    for i in (1..removal_chunks.len()).rev() {
        removal_chunks.swap(i, rng.below(i + 1));
    }
    let removals = removal_chunks.iter().map(|r| removed(&hashes(r))).collect();
    Case {
        gpu,
        slow,
        removals,
        prompt,
    }
}

/// Interleaves two sequences at random (each keeps its own order), then cuts the result
/// into batches of random sizes.
fn interleave(rng: &mut Rng, a: &[Ev], b: &[Ev]) -> Vec<Vec<Ev>> {
    let (mut i, mut j) = (0, 0);
    let mut merged = Vec::new();
    while i < a.len() || j < b.len() {
        let take_a = j == b.len() || (i < a.len() && rng.chance(0.5));
        if take_a {
            merged.push(a[i].clone());
            i += 1;
        } else {
            merged.push(b[j].clone());
            j += 1;
        }
    }
    let mut batches = Vec::new();
    let mut at = 0;
    while at < merged.len() {
        let stop = (at + rng.range(1, 3)).min(merged.len());
        batches.push(merged[at..stop].to_vec());
        at = stop;
    }
    batches
}

/// Per prompt: every worker's hit, and worker a's blocks per tier.
type Outcome = Vec<(Vec<(String, Hit)>, [i64; 4])>;

fn result(index: &mut Index, prompts: &[Vec<u32>]) -> Outcome {
    prompts
        .iter()
        .map(|p| {
            let hits = lookup(index, p).into_iter().collect();
            (hits, blocks(index, "a"))
        })
        .collect()
}

fn run(cases: &[Case], order: &mut dyn FnMut(&Case) -> Vec<Vec<Ev>>) -> Outcome {
    let mut index = Index::new(b"", RecentPolicy::default());
    index
        .register_worker("a", M, BS, false, None, None)
        .unwrap();
    index
        .register_worker("b", M, BS, false, None, None)
        .unwrap();
    for c in cases {
        apply(&mut index, "b", &c.gpu); // another worker holds the same chains in GPU
        apply(&mut index, "a", &c.gpu);
    }
    for c in cases {
        for batch in order(c) {
            apply(&mut index, "a", &batch);
        }
    }
    let prompts: Vec<Vec<u32>> = cases.iter().map(|c| c.prompt.clone()).collect();
    result(&mut index, &prompts)
}

#[test]
fn any_interleaving_of_slow_stores_and_gpu_removals_gives_the_same_credit() {
    for seed in 1..=300u64 {
        let mut rng = Rng(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1);
        let cases: Vec<Case> = (0..rng.range(1, 3))
            .map(|d| case(&mut rng, d as u64 + 1))
            .collect();
        let canonical = run(&cases, &mut |c| vec![c.slow.clone(), c.removals.clone()]);
        for (i, c) in cases.iter().enumerate() {
            // every block ends in the slower tier only, on worker a; b keeps its GPU copy
            let (hits, _) = &canonical[i];
            let a = &hits.iter().find(|(w, _)| w == "a").unwrap().1;
            let b = &hits.iter().find(|(w, _)| w == "b").unwrap().1;
            assert_eq!(a.tokens, c.prompt.len() as u64, "seed {seed}");
            assert_eq!(a.tiers[0], 0, "seed {seed}");
            assert_eq!(b.tiers[0], c.prompt.len() as u64, "seed {seed}");
        }
        let reversed = run(&cases, &mut |c| vec![c.removals.clone(), c.slow.clone()]);
        assert_eq!(reversed, canonical, "seed {seed}: all removals first");
        for trial in 0..5 {
            let mut order_rng = Rng(seed * 31 + trial + 1);
            let shuffled = run(&cases, &mut |c| {
                interleave(&mut order_rng, &c.slow, &c.removals)
            });
            assert_eq!(shuffled, canonical, "seed {seed} trial {trial}");
        }
    }
}

#[test]
fn without_the_rule_a_removal_first_would_lose_the_chain() {
    // The same scenario with no memory of removed blocks (capacity 0): the moves are
    // unknown, so the credit depends on the order.
    let mut index = Index::new(
        b"",
        RecentPolicy {
            min_blocks: 0,
            peak_factor: 0.0,
        },
    );
    index
        .register_worker("a", M, BS, false, None, None)
        .unwrap();
    let prompt = toks(3, 10);
    apply(&mut index, "a", &[stored(&[1, 2, 3], &prompt)]);
    apply(
        &mut index,
        "a",
        &[removed(&[1, 2, 3]), moved(&[1, 2, 3], "CPU")],
    );
    assert_eq!(lookup(&mut index, &prompt)["a"].tokens, 0);
    let mut index = Index::new(b"", RecentPolicy::default());
    index
        .register_worker("a", M, BS, false, None, None)
        .unwrap();
    apply(&mut index, "a", &[stored(&[1, 2, 3], &prompt)]);
    apply(
        &mut index,
        "a",
        &[removed(&[1, 2, 3]), moved(&[1, 2, 3], "CPU")],
    );
    assert_eq!(lookup(&mut index, &prompt)["a"].tokens, 6);
}
