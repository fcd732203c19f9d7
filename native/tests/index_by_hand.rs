//! The index's behaviour by hand: the cases of the Python reference's tests
//! (tests/unit/test_index.py and the index part of test_approx.py), ported, plus the
//! cross-tier rule.

mod common;

use common::*;
use foretoken_native::hash::Tokens;
use foretoken_native::snapshot::{restore, snapshot, SnapshotError, SNAPSHOT_VERSION};
use foretoken_native::{Hit, Index, IndexError, RecentPolicy};

fn hit(block_size: u32, tokens: u64, gpu: u64) -> Hit {
    Hit {
        block_size,
        tokens,
        tiers: [gpu, 0, 0, 0],
        approximate: false,
    }
}

fn map(pairs: &[(&'static str, u64)]) -> std::collections::BTreeMap<&'static str, u64> {
    pairs.iter().copied().collect()
}

#[test]
fn each_worker_gets_its_longest_prefix_in_one_lookup() {
    let mut index = fresh(&["a", "b", "c"]);
    let prompt = toks(4, 100);
    apply(&mut index, "a", &[stored(&[1, 2, 3, 4], &prompt)]);
    apply(
        &mut index,
        "b",
        &[
            stored(&[5], &prompt[..2]),
            stored(&[6], &prompt[2..4]).parent(5),
        ],
    );
    let mut query = prompt.clone();
    query.push(7); // a trailing partial block is never credited
    let hits = lookup(&mut index, &query);
    let tokens: Vec<u64> = ["a", "b", "c"].iter().map(|w| hits[*w].tokens).collect();
    assert_eq!(tokens, vec![8, 4, 0]);
    assert_eq!(tokens_of(&hits["a"]), map(&[("GPU", 8)]));
}

#[test]
fn a_chain_split_across_events_hashes_like_one_event() {
    let mut index = fresh(&["a", "b"]);
    let prompt = toks(3, 100);
    apply(&mut index, "a", &[stored(&[1, 2, 3], &prompt)]);
    apply(&mut index, "b", &[stored(&[9], &prompt[..2])]);
    apply(&mut index, "b", &[stored(&[8], &prompt[2..4]).parent(9)]);
    apply(&mut index, "b", &[stored(&[7], &prompt[4..6]).parent(8)]);
    assert_eq!(lookup(&mut index, &prompt)["b"].tokens, 6);
    let own = index.hash_prompt(M, BS as usize, Tokens::Ids(&prompt), None, &[]);
    assert_eq!(own.len(), 3);
    let by_hashes: Vec<_> = index
        .lookup(M, None, &[(BS as u32, &own)], None, &[], None)
        .into_iter()
        .map(|(w, h)| (w.to_owned(), h))
        .collect();
    let by_tokens: Vec<_> = lookup(&mut index, &prompt).into_iter().collect();
    assert_eq!(by_hashes, by_tokens);
}

#[test]
fn eviction_ends_the_prefix_at_the_evicted_block() {
    let mut index = fresh(&["a"]);
    let prompt = toks(4, 100);
    apply(&mut index, "a", &[stored(&[1, 2, 3, 4], &prompt)]);
    let stats = apply(&mut index, "a", &[removed(&[3])]);
    assert_eq!(stats.removed_blocks, 1);
    assert_eq!(lookup(&mut index, &prompt)["a"].tokens, 4);
    assert_eq!(blocks(&index, "a")[0], 3);
}

#[test]
fn a_duplicate_copy_needs_two_removals() {
    let mut index = fresh(&["a"]);
    let prompt = toks(1, 100);
    apply(
        &mut index,
        "a",
        &[stored(&[1], &prompt), stored(&[1], &prompt)],
    );
    apply(&mut index, "a", &[removed(&[1])]);
    assert_eq!(lookup(&mut index, &prompt)["a"].tokens, 2);
    apply(&mut index, "a", &[removed(&[1])]);
    assert_eq!(lookup(&mut index, &prompt)["a"].tokens, 0);
    assert_eq!(index.totals().duplicate_stores, 1);
    let third = apply(&mut index, "a", &[removed(&[1])]);
    assert_eq!(third.unknown_removals, 1);
}

#[test]
fn clear_all_per_medium_then_all() {
    let mut index = fresh(&["a", "b"]);
    let prompt = toks(2, 100);
    apply(
        &mut index,
        "a",
        &[
            stored(&[1], &prompt[..2]),
            stored(&[2], &prompt[2..]).parent(1).medium("CPU"),
        ],
    );
    apply(&mut index, "b", &[stored(&[1, 2], &prompt)]);
    apply(&mut index, "a", &[cleared(Some("CPU"))]);
    let hits = lookup(&mut index, &prompt);
    assert_eq!((hits["a"].tokens, hits["b"].tokens), (2, 4));
    apply(&mut index, "a", &[cleared(None)]);
    let hits = lookup(&mut index, &prompt);
    assert_eq!((hits["a"].tokens, hits["b"].tokens), (0, 4));
}

#[test]
fn a_store_without_tokens_moves_the_block_to_another_tier() {
    let mut index = fresh(&["a"]);
    let prompt = toks(2, 100);
    apply(&mut index, "a", &[stored(&[1, 2], &prompt)]);
    apply(&mut index, "a", &[moved(&[1, 2], "CPU")]);
    assert_eq!(
        tokens_of(&lookup(&mut index, &prompt)["a"]),
        map(&[("GPU", 4)])
    );
    apply(&mut index, "a", &[removed(&[1, 2])]);
    assert_eq!(
        tokens_of(&lookup(&mut index, &prompt)["a"]),
        map(&[("CPU", 4)])
    );
    apply(&mut index, "a", &[removed(&[1, 2]).medium("CPU")]);
    assert_eq!(lookup(&mut index, &prompt)["a"].tokens, 0);
    assert_eq!(
        apply(&mut index, "a", &[moved(&[77], "CPU")]).unknown_moves,
        1
    );
}

#[test]
fn a_prefix_continuing_in_a_slower_tier_is_split_per_tier() {
    let mut index = fresh(&["a"]);
    let prompt = toks(5, 100);
    apply(&mut index, "a", &[stored(&[1, 2], &prompt[..4])]);
    apply(
        &mut index,
        "a",
        &[stored(&[3, 4], &prompt[4..8]).parent(2).medium("CPU")],
    );
    apply(
        &mut index,
        "a",
        &[stored(&[5], &prompt[8..]).parent(4).medium("DISK")],
    );
    let hit = lookup(&mut index, &prompt)["a"];
    assert_eq!(tokens_of(&hit), map(&[("GPU", 4), ("CPU", 4), ("DISK", 2)]));
    assert_eq!(hit.tokens, 10);
}

#[test]
fn a_prefix_held_only_in_slower_tiers_is_credited_to_them() {
    let mut index = fresh(&["a"]);
    let prompt = toks(2, 100);
    apply(
        &mut index,
        "a",
        &[stored(&[1], &prompt[..2]).medium("DISK")],
    );
    apply(
        &mut index,
        "a",
        &[stored(&[2], &prompt[2..]).parent(1).medium("DISK")],
    );
    apply(&mut index, "a", &[moved(&[2], "CPU")]);
    assert_eq!(
        tokens_of(&lookup(&mut index, &prompt)["a"]),
        map(&[("DISK", 2), ("CPU", 2)])
    );
}

#[test]
fn eagle_does_not_credit_the_last_matched_block() {
    let mut index = fresh(&["plain"]);
    index
        .register_worker("eagle", M, BS, true, None, None)
        .unwrap();
    let prompt = toks(3, 100);
    for worker in ["plain", "eagle"] {
        apply(
            &mut index,
            worker,
            &[
                stored(&[1, 2], &prompt[..4]),
                stored(&[3], &prompt[4..]).parent(2).medium("CPU"),
            ],
        );
    }
    let hits = lookup(&mut index, &prompt);
    assert_eq!(tokens_of(&hits["plain"]), map(&[("GPU", 4), ("CPU", 2)]));
    assert_eq!(tokens_of(&hits["eagle"]), map(&[("GPU", 4)]));
    assert_eq!(lookup(&mut index, &prompt[..2])["eagle"].tokens, 0);
}

#[test]
fn only_full_attention_groups_count() {
    let mut index = fresh(&["a"]);
    let prompt = toks(2, 100);
    let stats = apply(
        &mut index,
        "a",
        &[stored(&[1, 2], &prompt).group(1).nonfull()],
    );
    assert_eq!(stats.ignored_blocks, 2);
    assert_eq!(lookup(&mut index, &prompt)["a"].tokens, 0);
    apply(&mut index, "a", &[stored(&[1, 2], &prompt)]);
    // the sliding-window group evicts its copy of the same hashes: the prefix stays
    apply(&mut index, "a", &[removed(&[1, 2]).group(1)]);
    assert_eq!(lookup(&mut index, &prompt)["a"].tokens, 4);
}

#[test]
fn two_full_attention_groups_hold_two_copies() {
    let mut index = fresh(&["a"]);
    let prompt = toks(2, 100);
    apply(
        &mut index,
        "a",
        &[
            stored(&[1, 2], &prompt).group(0),
            stored(&[1, 2], &prompt).group(1),
        ],
    );
    apply(&mut index, "a", &[removed(&[1, 2]).group(1)]);
    assert_eq!(lookup(&mut index, &prompt)["a"].tokens, 4);
    apply(&mut index, "a", &[removed(&[1, 2]).group(0)]);
    assert_eq!(lookup(&mut index, &prompt)["a"].tokens, 0);
}

#[test]
fn an_engine_hash_stored_again_with_its_parent_replaces_the_root_guess() {
    let mut index = fresh(&["a"]);
    let prompt = toks(2, 100);
    apply(&mut index, "a", &[stored(&[2], &prompt[2..]).parent(1)]); // parent unknown yet
    assert_eq!(lookup(&mut index, &prompt[2..])["a"].tokens, 2);
    let stats = apply(&mut index, "a", &[stored(&[1, 2], &prompt)]);
    assert_eq!(stats.remapped_blocks, 1);
    assert_eq!(lookup(&mut index, &prompt[2..])["a"].tokens, 0);
    assert_eq!(lookup(&mut index, &prompt)["a"].tokens, 4);
    apply(&mut index, "a", &[removed(&[2])]);
    assert_eq!(lookup(&mut index, &prompt)["a"].tokens, 2);
}

#[test]
fn every_worker_of_the_model_is_reported() {
    let mut index = fresh(&["a", "b"]);
    index
        .register_worker("other-model", "n", BS, false, None, None)
        .unwrap();
    apply(&mut index, "a", &[stored(&[1], &toks(1, 100))]);
    let hits: Vec<(String, Hit)> = index
        .lookup(M, None, &[], None, &[], None)
        .into_iter()
        .map(|(w, h)| (w.to_owned(), h))
        .collect();
    assert_eq!(
        hits,
        vec![("a".into(), hit(2, 0, 0)), ("b".into(), hit(2, 0, 0))]
    );
    let names: Vec<String> = lookup(&mut index, &toks(3, 100)).into_keys().collect();
    assert_eq!(names, vec!["a", "b"]);
}

#[test]
fn several_block_sizes_in_one_model() {
    let mut index = Index::new(b"", RecentPolicy::default());
    index
        .register_worker("small", M, 2, false, None, None)
        .unwrap();
    index
        .register_worker("large", M, 4, false, None, None)
        .unwrap();
    let prompt = toks(4, 100);
    apply(
        &mut index,
        "small",
        &[stored(&[1, 2, 3], &prompt[..6]).block_size(2)],
    );
    apply(
        &mut index,
        "large",
        &[stored(&[9, 8], &prompt).block_size(4)],
    );
    let hits = lookup(&mut index, &prompt);
    assert_eq!(hits["small"], hit(2, 6, 6));
    assert_eq!(hits["large"], hit(4, 8, 8));
    let wrong = apply(
        &mut index,
        "large",
        &[stored(&[7], &prompt[..2]).block_size(2)],
    );
    assert_eq!(wrong.block_size_mismatch_blocks, 1);
    assert_eq!(index.block_sizes(M), vec![2, 4]);
}

#[test]
fn an_unknown_parent_starts_a_new_root_and_is_counted() {
    let mut index = fresh(&["a"]);
    let prompt = toks(2, 100);
    let stats = apply(&mut index, "a", &[stored(&[2], &prompt[2..]).parent(1)]);
    assert_eq!(stats.unknown_parents, 1);
    assert_eq!(lookup(&mut index, &prompt)["a"].tokens, 0);
    assert_eq!(lookup(&mut index, &prompt[2..])["a"].tokens, 2);
}

#[test]
fn lora_and_extra_keys_make_blocks_distinct() {
    let mut index = fresh(&["a"]);
    let prompt = toks(2, 100);
    apply(&mut index, "a", &[stored(&[1, 2], &prompt).lora("sql")]);
    assert_eq!(lookup(&mut index, &prompt)["a"].tokens, 0);
    assert_eq!(
        lookup_with(&mut index, &prompt, Some("sql"), &[], None)["a"].tokens,
        4
    );
    apply(
        &mut index,
        "a",
        &[stored(&[3, 4], &prompt).keys(&["[\"salt\"]", ""])],
    );
    assert_eq!(lookup(&mut index, &prompt)["a"].tokens, 0);
    assert_eq!(
        lookup_with(&mut index, &prompt, None, &["[\"salt\"]"], None)["a"].tokens,
        4
    );
}

#[test]
fn store_only_entries_age_out_after_the_ttl() {
    let mut index = Index::new(b"", RecentPolicy::default());
    index
        .register_worker("a", M, BS, false, Some(10.0), None)
        .unwrap();
    let prompt = toks(2, 100);
    apply(&mut index, "a", &[stored(&[1, 2], &prompt)]);
    let h = lookup(&mut index, &prompt)["a"];
    assert!(h.tokens == 4 && h.approximate);
    assert_eq!(index.maintain(9.0).expired_blocks, 0);
    assert_eq!(index.maintain(10.5).expired_blocks, 2);
    assert_eq!(lookup(&mut index, &prompt)["a"].tokens, 0);
    assert_eq!(engine_hashes(&index, "a"), 0);
}

#[test]
fn store_only_capacity_trims_the_least_recently_used() {
    let mut index = Index::new(b"", RecentPolicy::default());
    index
        .register_worker("a", M, BS, false, None, Some(2))
        .unwrap();
    let (first, second, third) = (toks(1, 100), toks(1, 200), toks(1, 300));
    apply_at(&mut index, "a", &[stored(&[1], &first)], 0, 0.0);
    apply_at(&mut index, "a", &[stored(&[2], &second)], 0, 1.0);
    lookup_with(&mut index, &first, None, &[], Some(2.0)); // `first` is the most recent
    let stats = apply_at(&mut index, "a", &[stored(&[3], &third)], 0, 3.0);
    assert_eq!(stats.trimmed_blocks, 1);
    let got: Vec<u64> = [&first, &second, &third]
        .iter()
        .map(|p| lookup(&mut index, p)["a"].tokens)
        .collect();
    assert_eq!(got, vec![2, 0, 2]);
}

#[test]
fn reset_forgets_and_flags_the_worker_until_it_clears() {
    let mut index = fresh(&["a", "b"]);
    let prompt = toks(2, 100);
    for worker in ["a", "b"] {
        apply(&mut index, worker, &[stored(&[1, 2], &prompt)]);
    }
    apply(&mut index, "a", &[reset("gap 5..9")]);
    index.reset_worker("b", "restart");
    let hits = lookup(&mut index, &prompt);
    assert!(hits.values().all(|h| h.tokens == 0 && h.approximate));
    let b = index
        .worker_stats()
        .into_iter()
        .find(|w| w.worker_id == "b")
        .unwrap();
    assert_eq!(b.last_reset_reason.as_deref(), Some("restart"));
    assert_eq!(index.totals().resets, 2);
    apply(&mut index, "a", &[cleared(None), stored(&[1, 2], &prompt)]);
    assert_eq!(lookup(&mut index, &prompt)["a"], hit(2, 4, 4));
}

#[test]
fn unknown_workers_and_models_are_counted_and_ignored() {
    let mut index = fresh(&["a"]);
    let evs = [stored(&[1], &toks(1, 100))];
    assert_eq!(apply(&mut index, "ghost", &evs).unknown_worker_batches, 1);
    let events: Vec<_> = evs.iter().map(Ev::as_event).collect();
    let other = index.apply("a", "other", 0, 0, &events, 0.0);
    assert_eq!(other.model_mismatch_batches, 1);
    assert_eq!(lookup(&mut index, &toks(1, 100))["a"].tokens, 0);
    assert!(index
        .lookup(
            "other",
            Some(Tokens::Ids(&toks(1, 100))),
            &[],
            None,
            &[],
            None
        )
        .is_empty());
}

#[test]
fn more_than_64_workers() {
    let names: Vec<String> = (0..70).map(|i| format!("w{i}")).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut index = fresh(&refs);
    let prompt = toks(70, 100);
    for (i, w) in refs.iter().enumerate() {
        let hashes: Vec<u64> = (1..=i as u64).collect();
        apply(&mut index, w, &[stored(&hashes, &prompt[..2 * i])]);
    }
    let hits = lookup(&mut index, &prompt);
    let got: Vec<u64> = refs.iter().map(|w| hits[*w].tokens).collect();
    assert_eq!(got, (0..70).map(|i| 2 * i).collect::<Vec<u64>>());
    index.remove_worker("w69");
    assert!(!lookup(&mut index, &prompt).contains_key("w69"));
    // the freed slot is taken again, starting empty
    index
        .register_worker("new", M, BS, false, None, None)
        .unwrap();
    assert_eq!(lookup(&mut index, &prompt)["new"].tokens, 0);
}

#[test]
fn register_rejects_bad_values() {
    let mut index = fresh(&[]);
    assert_eq!(
        index.register_worker("a", M, 0, false, None, None),
        Err(IndexError::BadBlockSize(0))
    );
    assert!(index
        .register_worker("a", M, -1, false, None, None)
        .is_err());
    assert_eq!(
        index.register_worker("a", M, 2, false, Some(0.0), None),
        Err(IndexError::BadTtl)
    );
    assert_eq!(
        index.register_worker("a", M, 2, false, None, Some(0)),
        Err(IndexError::BadCapacity)
    );
    assert_eq!(
        IndexError::BadBlockSize(0).to_string(),
        "block_size must be >= 1, got 0"
    );
}

#[test]
fn re_registering_with_another_block_size_starts_afresh() {
    let mut index = fresh(&["a"]);
    apply(&mut index, "a", &[stored(&[1, 2], &toks(2, 100))]);
    index.register_worker("a", M, BS, true, None, None).unwrap(); // flags only
    assert_eq!(engine_hashes(&index, "a"), 2);
    index.register_worker("a", M, 4, false, None, None).unwrap();
    assert_eq!(engine_hashes(&index, "a"), 0);
    assert_eq!(index.space_stats()[0].entries, [0; 4]);
}

#[test]
fn snapshot_restore_round_trip() {
    let mut index = fresh(&["a"]);
    index
        .register_worker("b", M, BS, true, Some(30.0), Some(10))
        .unwrap();
    let prompt = toks(3, 100);
    let events = [
        stored(&[1, 2], &prompt[..4]),
        stored(&[1], &prompt[..2]),
        stored(&[3], &prompt[4..]).parent(2).medium("CPU"),
    ];
    for worker in ["a", "b"] {
        apply_at(&mut index, worker, &events, 7, 1.0);
    }
    apply_at(
        &mut index,
        "a",
        &[
            stored(&[5], &toks(1, 900)).group(2).nonfull(),
            removed(&[3]).medium("CPU"),
        ],
        8,
        1.0,
    );
    lookup_with(&mut index, &prompt, None, &[], Some(1.5));
    let data = snapshot(&index);
    let mut copy = restore(&data).expect("restores");
    assert_eq!(snapshot(&copy), data);
    assert_eq!(lookup(&mut copy, &prompt), lookup(&mut index, &prompt));
    assert_eq!(copy.worker_stats(), index.worker_stats());
    assert_eq!(copy.space_stats(), index.space_stats());
    assert_eq!(copy.last_seq("a"), vec![(0, 8)]);
    let later = [
        removed(&[1]),
        removed(&[1]),
        removed(&[5]).group(2),
        moved(&[3], "DISK"),
    ];
    for target in [&mut index, &mut copy] {
        apply_at(target, "a", &later, 9, 2.0);
    }
    assert_eq!(snapshot(&copy), snapshot(&index));
    assert_eq!(copy.totals().recovered_moves, 1);
}

#[test]
fn restore_refuses_foreign_old_and_damaged_data() {
    assert_eq!(
        restore(b"\x96\x01\x02").unwrap_err(),
        SnapshotError::Foreign
    );
    let data = snapshot(&fresh(&["a"]));
    let mut old = data.clone();
    old[8] = 9;
    assert_eq!(restore(&old).unwrap_err(), SnapshotError::Version(9));
    assert!(restore(&old)
        .unwrap_err()
        .to_string()
        .contains(&format!("this build reads {SNAPSHOT_VERSION}")));
    let mut spec = data.clone();
    spec[12] = 1;
    assert_eq!(restore(&spec).unwrap_err(), SnapshotError::HashSpec(1));
    let cut = &data[..data.len() - 3];
    assert!(matches!(restore(cut), Err(SnapshotError::Corrupt(_))));
    let mut flipped = data.clone();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 1;
    assert!(matches!(restore(&flipped), Err(SnapshotError::Corrupt(_))));
}

// --------------------------------------------------------------------------- approximate mode

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

// --------------------------------------------------------------------------- cross-tier rule

#[test]
fn a_move_after_the_gpu_removal_still_files_the_block() {
    let mut index = fresh(&["a"]);
    let prompt = toks(2, 100);
    apply(&mut index, "a", &[stored(&[1, 2], &prompt)]);
    apply(&mut index, "a", &[removed(&[1, 2])]); // GPU copy freed before the offload lands
    assert_eq!(lookup(&mut index, &prompt)["a"].tokens, 0);
    let stats = apply(&mut index, "a", &[moved(&[1, 2], "CPU")]);
    assert_eq!(stats.unknown_moves, 0);
    assert_eq!(
        tokens_of(&lookup(&mut index, &prompt)["a"]),
        map(&[("CPU", 4)])
    );
    assert_eq!(index.totals().recovered_moves, 2);
}

#[test]
fn a_store_naming_a_removed_parent_chains_from_it() {
    let mut index = fresh(&["a"]);
    let prompt = toks(3, 100);
    apply(&mut index, "a", &[stored(&[1, 2], &prompt[..4])]);
    apply(&mut index, "a", &[stored(&[1], &prompt[..2]).medium("CPU")]);
    apply(&mut index, "a", &[removed(&[1, 2])]); // block 2 is gone from every tier
    let stats = apply(
        &mut index,
        "a",
        &[stored(&[3], &prompt[4..]).parent(2).medium("CPU")],
    );
    assert_eq!(stats.unknown_parents, 0);
    assert_eq!(index.totals().recovered_parents, 1);
    // block 2 is missing, so the CPU prefix ends after block 1; block 3 is filed under the
    // right own hash, which a later move of block 2 completes
    assert_eq!(
        tokens_of(&lookup(&mut index, &prompt)["a"]),
        map(&[("CPU", 2)])
    );
    apply(&mut index, "a", &[moved(&[2], "CPU")]);
    assert_eq!(
        tokens_of(&lookup(&mut index, &prompt)["a"]),
        map(&[("CPU", 6)])
    );
}

#[test]
fn the_recently_removed_are_bounded_and_cleared_with_the_cache() {
    let mut index = Index::new(
        b"",
        RecentPolicy {
            min_blocks: 4, // one set of four
            peak_factor: 0.0,
        },
    );
    index
        .register_worker("a", M, BS, false, None, None)
        .unwrap();
    let prompt = toks(6, 100);
    let all = [1, 2, 3, 4, 5, 6];
    apply(&mut index, "a", &[stored(&all, &prompt)]);
    apply(&mut index, "a", &[removed(&all)]);
    let stats = apply(&mut index, "a", &[moved(&all, "CPU")]);
    assert_eq!(stats.unknown_moves, 2); // only the last four removals are remembered
    let stats = apply(&mut index, "a", &[removed(&all).medium("CPU")]);
    assert_eq!(stats.removed_blocks, 4);
    apply(&mut index, "a", &[cleared(None)]);
    assert_eq!(
        apply(&mut index, "a", &[moved(&[5, 6], "CPU")]).unknown_moves,
        2
    );
}
