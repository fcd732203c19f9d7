//! Engine blocks that span several of the worker's blocks (LMCache's chunks: one store per
//! 256-token chunk, its removals by chunk hash). A port of the Python reference's
//! `foretoken.core.index.spans`: a store whose block size is a multiple of the worker's is
//! filed as the blocks it spans, the last under the chunk's engine hash and the others
//! under hashes derived from it ([`inner_hash`]); the worker remembers each chunk's span so
//! that a removal or a tier move takes every spanned block.

use crate::flat::FlatMap;
use crate::table::U64Map;

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;
/// A chunk spans at most this many of the worker's blocks: a larger one is a block-size
/// mismatch, and a rebuild stops probing there.
pub const MAX_SPAN: usize = 4096;

/// The engine hash filed for the `i`-th (0-based) block of a span before its last
/// (splitmix64 of the span's engine hash and the position).
#[inline]
pub fn inner_hash(engine: u64, i: usize) -> u64 {
    let mut z = engine.wrapping_add((i as u64 + 1).wrapping_mul(GOLDEN));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// How many of the worker's blocks each of a store's `events` engine blocks spans; 0 when
/// the store cannot be filed in the worker's blocks.
pub fn span_of(event_block_size: i64, worker_block_size: u32, events: usize) -> usize {
    let worker = i64::from(worker_block_size);
    if event_block_size <= worker {
        return 0;
    }
    if event_block_size % worker != 0 && events != 1 {
        return 0;
    }
    match usize::try_from(event_block_size / worker) {
        Ok(span) if span <= MAX_SPAN => span,
        _ => 0,
    }
}

/// The engine hashes of the spanned blocks (each span's inner blocks, then its own hash)
/// and the extra keys, each on its span's first block.
pub fn split(
    hashes: &[u64],
    span: usize,
    extra_keys: &[Option<u64>],
) -> (Vec<u64>, Vec<Option<u64>>) {
    let mut out = Vec::with_capacity(hashes.len() * span);
    for &engine in hashes {
        out.extend((0..span - 1).map(|i| inner_hash(engine, i)));
        out.push(engine);
    }
    let mut keys = Vec::new();
    if extra_keys.iter().any(Option::is_some) {
        keys.reserve(extra_keys.len() * span);
        for &key in extra_keys {
            keys.push(key);
            keys.extend(std::iter::repeat_n(None, span - 1));
        }
    }
    (out, keys)
}

/// A removal's or a tier move's engine hashes with every spanned block named.
pub fn expand(spans: &U64Map<u32>, hashes: &[u64]) -> Vec<u64> {
    let mut out = Vec::with_capacity(hashes.len());
    for &engine in hashes {
        let span = spans.get(&engine).map_or(1, |&s| s as usize);
        out.extend((0..span.saturating_sub(1)).map(|i| inner_hash(engine, i)));
        out.push(engine);
    }
    out
}

/// The spans of a restored engine map: an engine hash whose first inner hash is mapped too
/// spans as many blocks as its inner hashes that are, plus one.
pub fn rebuild(emap: &FlatMap) -> U64Map<u32> {
    let mut spans = U64Map::default();
    for (engine, _) in emap.iter() {
        if !emap.contains_key(inner_hash(engine, 0)) {
            continue;
        }
        let mut n = 1;
        while n < MAX_SPAN && emap.contains_key(inner_hash(engine, n)) {
            n += 1;
        }
        spans.insert(engine, (n + 1) as u32);
    }
    spans
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inner_hashes_are_the_reference_ones() {
        // values from foretoken.core.index.spans.inner_hash
        assert_eq!(inner_hash(0, 0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(inner_hash(u64::MAX, 3), inner_hash(u64::MAX, 3));
        assert_ne!(inner_hash(7, 0), inner_hash(7, 1));
    }

    #[test]
    fn spans_of_stores() {
        assert_eq!(span_of(256, 16, 3), 16);
        assert_eq!(span_of(88, 16, 1), 5);
        assert_eq!(span_of(88, 16, 2), 0);
        assert_eq!(span_of(16, 16, 1), 0);
        assert_eq!(span_of(8, 16, 1), 0);
        assert_eq!(span_of(4096 * 2, 2, 1), MAX_SPAN);
        assert_eq!(span_of(4097 * 2, 2, 1), 0);
    }

    #[test]
    fn split_and_expand_agree() {
        let (hashes, keys) = split(&[5, 9], 3, &[]);
        assert_eq!(hashes.len(), 6);
        assert_eq!(hashes[2], 5);
        assert_eq!(hashes[5], 9);
        assert!(keys.is_empty());
        let mut spans = U64Map::default();
        spans.insert(5u64, 3u32);
        assert_eq!(expand(&spans, &[5, 9]), vec![hashes[0], hashes[1], 5, 9]);
        let (_, keys) = split(&[5, 9], 2, &[Some(1), None]);
        assert_eq!(keys, vec![Some(1), None, None, None]);
    }
}
