//! `FlatMap`: the index's u64 → u64 map (engine maps, mask tables), a thin layer over
//! hashbrown with the operations the index needs in one probe each, and `touch` to start a
//! batch's cache misses before its real pass.
//!
//! (An open-addressing Robin Hood table with keys and values side by side was tried in its
//! place and measured slower on this machine: hashbrown's control bytes mostly stay in
//! cache, so a hit costs one miss there too.)

use hashbrown::hash_map::Entry;

use crate::table::U64Map;

#[derive(Clone, Debug, Default)]
pub struct FlatMap(U64Map<u64>);

impl FlatMap {
    pub fn with_capacity(n: usize) -> Self {
        Self(U64Map::with_capacity_and_hasher(n, Default::default()))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Looks the key up and discards the result: the cache misses of a batch of lookups
    /// then overlap, and the real pass finds the lines in cache.
    #[inline]
    pub fn touch(&self, key: u64) {
        std::hint::black_box(self.0.get(&key));
    }

    #[inline]
    pub fn get(&self, key: u64) -> Option<u64> {
        self.0.get(&key).copied()
    }

    pub fn contains_key(&self, key: u64) -> bool {
        self.0.contains_key(&key)
    }

    pub fn get_mut(&mut self, key: u64) -> Option<&mut u64> {
        self.0.get_mut(&key)
    }

    /// The value of `key`, inserting `value` if absent: `(inserted, &mut value)`.
    #[inline]
    pub fn get_or_insert(&mut self, key: u64, value: u64) -> (bool, &mut u64) {
        match self.0.entry(key) {
            Entry::Occupied(e) => (false, e.into_mut()),
            Entry::Vacant(e) => (true, e.insert(value)),
        }
    }

    /// Sets the value; returns the previous one.
    pub fn insert(&mut self, key: u64, value: u64) -> Option<u64> {
        self.0.insert(key, value)
    }

    pub fn remove(&mut self, key: u64) -> Option<u64> {
        self.0.remove(&key)
    }

    /// Replaces the value by `f(value)`, removing the entry when that is 0; returns the
    /// previous value (None, and no change, if absent).
    #[inline]
    pub fn update_or_remove(&mut self, key: u64, f: impl FnOnce(u64) -> u64) -> Option<u64> {
        match self.0.entry(key) {
            Entry::Vacant(_) => None,
            Entry::Occupied(mut e) => {
                let old = *e.get();
                let new = f(old);
                if new == 0 {
                    e.remove();
                } else {
                    *e.get_mut() = new;
                }
                Some(old)
            }
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.0.iter().map(|(&k, &v)| (k, v))
    }

    pub fn values(&self) -> impl Iterator<Item = u64> + '_ {
        self.0.values().copied()
    }

    /// Bytes of the table (buckets of 16 bytes + 1 control byte), estimated from its
    /// capacity (hashbrown keeps buckets a power of two, at most 7/8 full).
    pub fn heap_bytes(&self) -> usize {
        table_bytes(self.0.capacity(), 17)
    }
}

/// hashbrown's allocation for a table that holds `capacity` entries of `slot` bytes.
pub fn table_bytes(capacity: usize, slot: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        (capacity + 1).next_power_of_two()
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    buckets * slot + 16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn update_or_remove_drops_zero_values() {
        let mut map = FlatMap::default();
        assert_eq!(map.get_or_insert(5, 3), (true, &mut 3));
        assert_eq!(map.get_or_insert(5, 9), (false, &mut 3));
        assert_eq!(map.update_or_remove(5, |m| m & !1), Some(3));
        assert_eq!(map.get(5), Some(2));
        assert_eq!(map.update_or_remove(5, |m| m & !2), Some(2));
        assert_eq!((map.get(5), map.len()), (None, 0));
        assert_eq!(map.update_or_remove(5, |m| m), None);
    }
}
