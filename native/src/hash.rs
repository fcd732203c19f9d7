//! foretoken's own chained content hash of KV blocks, spec "v2".
//!
//! * `root_seed = xxh3_64(b"foretoken-root-v2" 1F salt 1F model 1F str(block_size) 1F lora)`
//!   where `lora` is `00` for no adapter, else `01` followed by the adapter's name (UTF-8).
//! * `extra_key_mix(key) = xxh3_64(b"extra" 1F key)` for a non-empty key, 0 for `""`.
//! * `h[i] = xxh3_64_with_seed(data[i], seed = h[i-1])`, `h[-1] = seed`, over the full blocks
//!   only; `data[i]` is the block's token ids as u32 little-endian, followed by the block's
//!   extra key mix as u64 little-endian when the block has a non-empty extra key.
//!
//! All 64 bits are kept. The Python reference computes the same values with PyPI's `xxhash`
//! (`xxh3_64_intdigest(data, seed=...)`); `tests/test_hash.py` checks both agree.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// The field separator of the text hashes.
pub const SEP: u8 = 0x1f;
/// The domain tag of the root seed (names the spec version).
pub const ROOT_TAG: &[u8] = b"foretoken-root-v2";
/// The spec version, stored in snapshots.
pub const HASH_SPEC: u32 = 2;

/// The chain's starting value for one (salt, model, block size, LoRA adapter).
pub fn root_seed(salt: &[u8], model: &str, block_size: i64, lora_name: Option<&str>) -> u64 {
    let size = block_size.to_string();
    let mut data = Vec::with_capacity(ROOT_TAG.len() + salt.len() + model.len() + 40);
    data.extend_from_slice(ROOT_TAG);
    data.push(SEP);
    data.extend_from_slice(salt);
    data.push(SEP);
    data.extend_from_slice(model.as_bytes());
    data.push(SEP);
    data.extend_from_slice(size.as_bytes());
    data.push(SEP);
    match lora_name {
        None => data.push(0),
        Some(name) => {
            data.push(1);
            data.extend_from_slice(name.as_bytes());
        }
    }
    xxh3_64(&data)
}

/// A block's extra key (multimodal hashes, cache salt …) as a u64; 0 for none.
pub fn extra_key_mix(key: &str) -> u64 {
    if key.is_empty() {
        return 0;
    }
    let mut data = Vec::with_capacity(6 + key.len());
    data.extend_from_slice(b"extra");
    data.push(SEP);
    data.extend_from_slice(key.as_bytes());
    xxh3_64(&data)
}

/// Per block: `Some(mix)` for a block with a non-empty extra key, `None` otherwise.
pub fn key_mixes<S: AsRef<str>>(keys: &[S]) -> Vec<Option<u64>> {
    keys.iter()
        .map(|k| {
            let k = k.as_ref();
            (!k.is_empty()).then(|| extra_key_mix(k))
        })
        .collect()
}

/// Token ids, either packed (u32 little-endian, what the router sends) or as ids.
#[derive(Clone, Copy, Debug)]
pub enum Tokens<'a> {
    /// Packed u32 little-endian; a length that is not a multiple of 4 is refused upstream.
    Packed(&'a [u8]),
    Ids(&'a [u32]),
}

impl Tokens<'_> {
    pub fn len(&self) -> usize {
        match self {
            Tokens::Packed(b) => b.len() / 4,
            Tokens::Ids(ids) => ids.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of full blocks.
    pub fn blocks(&self, block_size: usize) -> usize {
        self.len().checked_div(block_size).unwrap_or(0)
    }
}

/// Hashes blocks `start..stop` of `tokens` (absolute block numbers, full blocks only),
/// chained from `prev` (the hash of block `start - 1`, or the root seed), appending to `out`.
/// `mixes[i]` is block `i`'s extra key; blocks past its end have none.
pub fn chain_range(
    prev: u64,
    tokens: Tokens<'_>,
    block_size: usize,
    mixes: &[Option<u64>],
    start: usize,
    stop: usize,
    out: &mut Vec<u64>,
) -> u64 {
    let width = block_size * 4;
    let mut h = prev;
    out.reserve(stop.saturating_sub(start));
    let mut scratch: Vec<u8> = Vec::new();
    match tokens {
        Tokens::Packed(bytes) => {
            for i in start..stop {
                let data = &bytes[i * width..(i + 1) * width];
                h = match mixes.get(i).copied().flatten() {
                    None => xxh3_64_with_seed(data, h),
                    Some(mix) => {
                        scratch.clear();
                        scratch.extend_from_slice(data);
                        scratch.extend_from_slice(&mix.to_le_bytes());
                        xxh3_64_with_seed(&scratch, h)
                    }
                };
                out.push(h);
            }
        }
        Tokens::Ids(ids) => {
            scratch.resize(width + 8, 0);
            for i in start..stop {
                let block = &ids[i * block_size..(i + 1) * block_size];
                for (dst, id) in scratch[..width].chunks_exact_mut(4).zip(block) {
                    dst.copy_from_slice(&id.to_le_bytes());
                }
                h = match mixes.get(i).copied().flatten() {
                    None => xxh3_64_with_seed(&scratch[..width], h),
                    Some(mix) => {
                        scratch[width..].copy_from_slice(&mix.to_le_bytes());
                        xxh3_64_with_seed(&scratch, h)
                    }
                };
                out.push(h);
            }
        }
    }
    h
}

/// Own hashes of the full blocks of `tokens` chained from `seed` (at most `max_blocks`).
pub fn chain(
    seed: u64,
    tokens: Tokens<'_>,
    block_size: usize,
    mixes: &[Option<u64>],
    max_blocks: Option<usize>,
) -> Vec<u64> {
    let mut blocks = tokens.blocks(block_size);
    if let Some(limit) = max_blocks {
        blocks = blocks.min(limit);
    }
    let mut out = Vec::with_capacity(blocks);
    chain_range(seed, tokens, block_size, mixes, 0, blocks, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packed(ids: &[u32]) -> Vec<u8> {
        ids.iter().flat_map(|t| t.to_le_bytes()).collect()
    }

    #[test]
    fn root_seed_follows_the_spec_bytes() {
        let mut expected = b"foretoken-root-v2\x1fsalt\x1fm\x1f16\x1f\x01lora".to_vec();
        assert_eq!(
            root_seed(b"salt", "m", 16, Some("lora")),
            xxh3_64(&expected)
        );
        expected = b"foretoken-root-v2\x1f\x1fm\x1f16\x1f\x00".to_vec();
        assert_eq!(root_seed(b"", "m", 16, None), xxh3_64(&expected));
        assert_ne!(
            root_seed(b"", "m", 16, None),
            root_seed(b"", "m", 16, Some(""))
        );
    }

    #[test]
    fn each_block_is_seeded_by_the_previous_hash() {
        let ids: Vec<u32> = (0..10).collect();
        let seed = 42;
        let got = chain(seed, Tokens::Ids(&ids), 4, &[], None);
        assert_eq!(got.len(), 2); // the partial block is ignored
        let b0 = xxh3_64_with_seed(&packed(&ids[..4]), seed);
        let b1 = xxh3_64_with_seed(&packed(&ids[4..8]), b0);
        assert_eq!(got, vec![b0, b1]);
        let bytes = packed(&ids);
        assert_eq!(chain(seed, Tokens::Packed(&bytes), 4, &[], None), got);
        assert_eq!(
            chain(seed, Tokens::Packed(&bytes), 4, &[], Some(1)),
            vec![b0]
        );
    }

    #[test]
    fn an_extra_key_is_appended_to_its_block_only() {
        let ids: Vec<u32> = (100..108).collect();
        let mixes = key_mixes(&["", "k"]);
        assert_eq!(mixes, vec![None, Some(extra_key_mix("k"))]);
        let got = chain(7, Tokens::Ids(&ids), 4, &mixes, None);
        let b0 = xxh3_64_with_seed(&packed(&ids[..4]), 7);
        let mut data = packed(&ids[4..]);
        data.extend_from_slice(&extra_key_mix("k").to_le_bytes());
        assert_eq!(got, vec![b0, xxh3_64_with_seed(&data, b0)]);
        let bytes = packed(&ids);
        assert_eq!(chain(7, Tokens::Packed(&bytes), 4, &mixes, None), got);
        assert_eq!(extra_key_mix(""), 0);
        assert_eq!(extra_key_mix("k"), xxh3_64(b"extra\x1fk"));
    }

    #[test]
    fn a_range_continues_a_chain() {
        let ids: Vec<u32> = (0..64).collect();
        let whole = chain(1, Tokens::Ids(&ids), 4, &[], None);
        let mut parts = Vec::new();
        let mid = chain_range(1, Tokens::Ids(&ids), 4, &[], 0, 5, &mut parts);
        chain_range(mid, Tokens::Ids(&ids), 4, &[], 5, 16, &mut parts);
        assert_eq!(parts, whole);
    }
}
