//! Hash maps keyed by u64 block hashes.
//!
//! Own hashes are xxh3 outputs, but engine hashes can be anything (small sequential ints in
//! tests, ids that differ only in their high bits), so every key goes through one folded
//! 64×64→128-bit multiply: cheap, and both halves of the result depend on every key bit,
//! which hashbrown needs (low bits pick the bucket, the top 7 bits are the control tag).

use std::hash::{BuildHasher, Hasher};

const K0: u64 = 0x243f_6a88_85a3_08d3;
const K1: u64 = 0x9e37_79b9_7f4a_7c15;

#[inline]
pub fn mix(x: u64) -> u64 {
    let p = u128::from(x ^ K0) * u128::from(K1);
    (p as u64) ^ ((p >> 64) as u64)
}

#[derive(Clone, Copy, Default, Debug)]
pub struct MixState;

#[derive(Clone, Copy, Default)]
pub struct MixHasher(u64);

impl Hasher for MixHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = mix(self.0 ^ u64::from_le_bytes(word));
        }
    }

    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.0 = mix(self.0 ^ x);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

impl BuildHasher for MixState {
    type Hasher = MixHasher;

    #[inline]
    fn build_hasher(&self) -> MixHasher {
        MixHasher(0)
    }
}

/// A map from a u64 hash.
pub type U64Map<V> = hashbrown::HashMap<u64, V, MixState>;

/// The bucket hash of a u64 key, as `U64Map` computes it (for `HashTable`s keyed by u64).
#[inline]
pub fn key_hash(x: u64) -> u64 {
    mix(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_keys_spread_over_tags_and_buckets() {
        let tags: std::collections::HashSet<u64> = (0..1000u64).map(|x| mix(x) >> 57).collect();
        assert!(tags.len() > 100);
        let high: std::collections::HashSet<u64> =
            (0..1000u64).map(|x| mix(x << 40) & 0xffff).collect();
        assert!(high.len() > 900);
        let state = MixState;
        assert_eq!(state.hash_one(5u64), key_hash(5));
    }
}
