//! `FlatMap`: the index's u64 → u64 map (engine maps, mask tables).
//!
//! Open addressing with linear probing and backward-shift deletion (no tombstones): a slot
//! is `[key, value]` (16 bytes, four to a cache line), key 0 marks an empty slot and the key
//! 0 itself lives beside the table. A key's home slot is its 64-bit mix (the
//! `table::mix` of every map here) scaled to the table, so a lookup costs one cache line
//! almost always (at most 4/5 full, ~0.6 on average) and its address is known before the
//! lookup: [`FlatMap::prefetch`] starts that line's miss while other work goes on, which
//! is how a batch of events overlaps its misses (`worker.rs`).
//!
//! Large tables (at least [`HUGE_BYTES`]) live in an anonymous mapping advised for
//! transparent huge pages (`memmap2`, safe API; `bytemuck` views the bytes as slots): at
//! 10 M entries the tables span hundreds of MB, and with 4 KiB pages nearly every probe
//! would also miss the TLB. Where the kernel gives no huge pages the advice is a no-op.
//!
//! (hashbrown was used before: its control bytes and its buckets are two separate arrays,
//! two misses per probe in a table much larger than the caches.)

use crate::prefetch::prefetch;
use crate::table::mix;

/// Tables of at least this many bytes are mapped with huge pages advised.
pub const HUGE_BYTES: usize = 2 << 20;
const MIN_SLOTS: usize = 8;

type Slot = [u64; 2];

/// The slots: a `Vec` for small tables, an anonymous mapping for large ones.
#[derive(Debug)]
enum Slots {
    Heap(Vec<Slot>),
    Mapped(memmap2::MmapMut),
}

impl Default for Slots {
    fn default() -> Self {
        Slots::Heap(Vec::new())
    }
}

impl Slots {
    /// `n` empty slots (n is a power of two).
    fn zeroed(n: usize) -> Self {
        let bytes = n * std::mem::size_of::<Slot>();
        if bytes >= HUGE_BYTES {
            if let Ok(map) = memmap2::MmapOptions::new().len(bytes).map_anon() {
                #[cfg(target_os = "linux")]
                let _ = map.advise(memmap2::Advice::HugePage); // a hint: no huge pages is fine
                return Slots::Mapped(map); // zero-filled by the kernel
            }
        }
        Slots::Heap(vec![[0, 0]; n])
    }

    #[inline]
    fn get(&self) -> &[Slot] {
        match self {
            Slots::Heap(v) => v,
            Slots::Mapped(m) => bytemuck::cast_slice(&m[..]),
        }
    }

    #[inline]
    fn get_mut(&mut self) -> &mut [Slot] {
        match self {
            Slots::Heap(v) => v,
            Slots::Mapped(m) => bytemuck::cast_slice_mut(&mut m[..]),
        }
    }
}

#[derive(Debug, Default)]
pub struct FlatMap {
    slots: Slots,
    /// Slots in use (the key 0 not counted).
    used: usize,
    /// The value of key 0, which cannot live in a slot.
    zero: Option<u64>,
    /// log2 of the slot count (0 when there are none).
    bits: u32,
}

impl Clone for FlatMap {
    fn clone(&self) -> Self {
        let mut copy = FlatMap::with_capacity(self.len());
        for (k, v) in self.iter() {
            copy.insert(k, v);
        }
        copy
    }
}

/// Where probing for `key` starts in a table of `2^bits` slots.
#[inline]
fn home(key: u64, bits: u32) -> usize {
    // the top bits of the mix: every key bit reaches them
    ((mix(key) as u128 * (1u128 << bits)) >> 64) as usize
}

impl FlatMap {
    pub fn with_capacity(n: usize) -> Self {
        let mut map = FlatMap::default();
        if n > 0 {
            map.resize(slots_for(n));
        }
        map
    }

    pub fn len(&self) -> usize {
        self.used + usize::from(self.zero.is_some())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    fn mask(&self) -> usize {
        (1usize << self.bits) - 1
    }

    /// Starts loading the cache line where `key` would be (a hint; nothing changes).
    #[inline]
    pub fn prefetch(&self, key: u64) {
        let slots = self.slots.get();
        if !slots.is_empty() {
            prefetch(&slots[home(key, self.bits)]);
        }
    }

    /// Like [`FlatMap::prefetch`], and the next line too: an insert probes on to the first
    /// empty slot and a removal's backward shift reads the slots after the entry, which
    /// cross into the next line often enough (at half load) that leaving that line to a
    /// demand miss cost ~30% of the ingest (`foretoken bench index --quick`: 2.2 M stored
    /// blocks per CPU-second with the next slot only, 2.9 M with the next line, alternated
    /// builds on one quiet machine).
    #[inline]
    pub fn prefetch_run(&self, key: u64) {
        let slots = self.slots.get();
        if !slots.is_empty() {
            let at = home(key, self.bits);
            prefetch(&slots[at]);
            prefetch(&slots[(at + 4) & self.mask()]);
        }
    }

    /// The slot of `key`, or `Err(the empty slot where it would go)`.
    #[inline]
    fn find(&self, key: u64) -> Result<usize, usize> {
        let slots = self.slots.get();
        let mask = self.mask();
        let mut i = home(key, self.bits);
        loop {
            let k = slots[i][0];
            if k == key {
                return Ok(i);
            }
            if k == 0 {
                return Err(i);
            }
            i = (i + 1) & mask;
        }
    }

    #[inline]
    pub fn get(&self, key: u64) -> Option<u64> {
        if key == 0 {
            return self.zero;
        }
        if self.used == 0 {
            return None;
        }
        self.find(key).ok().map(|i| self.slots.get()[i][1])
    }

    pub fn contains_key(&self, key: u64) -> bool {
        self.get(key).is_some()
    }

    /// Room for one more entry.
    #[inline]
    fn reserve_one(&mut self) {
        let slots = 1usize << self.bits;
        if self.bits == 0 || (self.used + 1) * 5 > slots * 4 {
            self.resize((slots * 2).max(MIN_SLOTS));
        }
    }

    fn resize(&mut self, n: usize) {
        let old = std::mem::replace(&mut self.slots, Slots::zeroed(n));
        self.bits = n.trailing_zeros();
        let mask = self.mask();
        let slots = self.slots.get_mut();
        for &[k, v] in old.get() {
            if k != 0 {
                let mut i = home(k, n.trailing_zeros());
                while slots[i][0] != 0 {
                    i = (i + 1) & mask;
                }
                slots[i] = [k, v];
            }
        }
    }

    /// The value of `key`, inserting `value` if absent: `(inserted, &mut value)`.
    #[inline]
    pub fn get_or_insert(&mut self, key: u64, value: u64) -> (bool, &mut u64) {
        if key == 0 {
            let inserted = self.zero.is_none();
            return (inserted, self.zero.get_or_insert(value));
        }
        if let Ok(i) = self.find_if_any(key) {
            return (false, &mut self.slots.get_mut()[i][1]);
        }
        self.reserve_one();
        let i = self.find(key).expect_err("absent");
        self.used += 1;
        let slot = &mut self.slots.get_mut()[i];
        *slot = [key, value];
        (true, &mut slot[1])
    }

    #[inline]
    fn find_if_any(&self, key: u64) -> Result<usize, ()> {
        if self.used == 0 {
            return Err(());
        }
        self.find(key).map_err(|_| ())
    }

    /// Sets the value; returns the previous one.
    pub fn insert(&mut self, key: u64, value: u64) -> Option<u64> {
        let (inserted, slot) = self.get_or_insert(key, value);
        if inserted {
            None
        } else {
            Some(std::mem::replace(slot, value))
        }
    }

    pub fn remove(&mut self, key: u64) -> Option<u64> {
        if key == 0 {
            return self.zero.take();
        }
        let i = self.find_if_any(key).ok()?;
        let value = self.slots.get()[i][1];
        self.delete_at(i);
        Some(value)
    }

    /// Empties slot `hole`, moving back the entries after it that would be unreachable.
    fn delete_at(&mut self, mut hole: usize) {
        let bits = self.bits;
        let mask = self.mask();
        let slots = self.slots.get_mut();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let k = slots[j][0];
            if k == 0 {
                break;
            }
            let want = home(k, bits);
            // the entry at j may fill the hole if its home is not in (hole, j], cyclically
            let between = if hole <= j {
                hole < want && want <= j
            } else {
                hole < want || want <= j
            };
            if !between {
                slots[hole] = slots[j];
                hole = j;
            }
        }
        slots[hole] = [0, 0];
        self.used -= 1;
    }

    /// Replaces the value by `f(value)`, removing the entry when that is 0; returns the
    /// previous value (None, and no change, if absent).
    #[inline]
    pub fn update_or_remove(&mut self, key: u64, f: impl FnOnce(u64) -> u64) -> Option<u64> {
        if key == 0 {
            let old = self.zero?;
            let new = f(old);
            self.zero = (new != 0).then_some(new);
            return Some(old);
        }
        let i = self.find_if_any(key).ok()?;
        let old = self.slots.get()[i][1];
        let new = f(old);
        if new == 0 {
            self.delete_at(i);
        } else {
            self.slots.get_mut()[i][1] = new;
        }
        Some(old)
    }

    /// Entries in table order (the key 0 first).
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.zero.map(|v| (0, v)).into_iter().chain(
            self.slots
                .get()
                .iter()
                .filter(|s| s[0] != 0)
                .map(|s| (s[0], s[1])),
        )
    }

    pub fn values(&self) -> impl Iterator<Item = u64> + '_ {
        self.iter().map(|(_, v)| v)
    }

    /// Bytes of the table.
    pub fn heap_bytes(&self) -> usize {
        std::mem::size_of_val(self.slots.get())
    }
}

/// The slot count (a power of two) that holds `n` entries at most 4/5 full.
fn slots_for(n: usize) -> usize {
    (n * 5 / 4 + 1).next_power_of_two().max(MIN_SLOTS)
}

/// hashbrown's allocation for a table that holds `capacity` entries of `slot` bytes (for
/// the small maps that stay on hashbrown: duplicate copies).
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
    use std::collections::HashMap;

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

    #[test]
    fn the_key_zero_is_a_key_like_any_other() {
        let mut map = FlatMap::default();
        assert_eq!(map.insert(0, 7), None);
        assert_eq!((map.get(0), map.len()), (Some(7), 1));
        assert_eq!(map.insert(0, 8), Some(7));
        assert_eq!(map.iter().collect::<Vec<_>>(), vec![(0, 8)]);
        assert_eq!(map.update_or_remove(0, |_| 0), Some(8));
        assert!(map.is_empty());
    }

    /// Random inserts, updates and removals against std's HashMap, with keys crowded into
    /// few home slots (long runs, wrap-around) and spread ones; large enough to be mapped.
    #[test]
    fn agrees_with_a_hash_map_through_growth_and_deletions() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for &range in &[64u64, 300_000] {
            let mut map = FlatMap::default();
            let mut model: HashMap<u64, u64> = HashMap::new();
            for step in 0..400_000u64 {
                let key = next() % range;
                match next() % 4 {
                    0 => assert_eq!(map.remove(key), model.remove(&key)),
                    1 => assert_eq!(map.insert(key, step | 1), model.insert(key, step | 1)),
                    2 => {
                        let want = model.get(&key).copied();
                        assert_eq!(map.update_or_remove(key, |v| v & 1), want);
                        if want.is_some() {
                            model.insert(key, 1);
                        }
                    }
                    _ => {
                        let (inserted, v) = map.get_or_insert(key, step | 1);
                        assert_eq!(inserted, !model.contains_key(&key));
                        assert_eq!(*v, *model.entry(key).or_insert(step | 1));
                    }
                }
                assert_eq!(map.len(), model.len());
            }
            for (k, v) in &model {
                assert_eq!(map.get(*k), Some(*v));
            }
            let mut pairs: Vec<_> = map.iter().collect();
            pairs.sort_unstable();
            let mut want: Vec<_> = model.into_iter().collect();
            want.sort_unstable();
            assert_eq!(pairs, want);
            assert_eq!(map.clone().iter().count(), pairs.len());
        }
    }
}
