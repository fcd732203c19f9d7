//! The index's behaviour by hand, events and lookups: the cases of the Python reference's
//! suite (tests/contract/test_index_contract.py) that store, remove, move and clear blocks
//! across tiers, groups, block sizes and adapters, ported, plus the cross-tier rule.
//! Workers' lifecycle and snapshots are in index_workers_by_hand.rs, approximate mode in
//! index_approx_by_hand.rs.

mod common;

use common::*;
use foretoken_native::hash::Tokens;
use foretoken_native::{Hit, Index, RecentPolicy};

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
