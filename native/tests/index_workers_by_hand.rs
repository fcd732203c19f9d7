//! The index's workers by hand: store-only aging and capacity, resets, unknown workers and
//! models, many workers, registration, and snapshots (the Python reference's
//! tests/contract/test_index_contract.py, ported).

mod common;

use common::*;
use foretoken_native::hash::Tokens;
use foretoken_native::snapshot::{restore, snapshot, SnapshotError, SNAPSHOT_VERSION};
use foretoken_native::{Index, IndexError, RecentPolicy};

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
