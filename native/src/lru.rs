//! The store-only producers' LRU: own hash → (engine hash, last store/lookup time), oldest
//! first, with O(1) removal and move-to-end (a doubly linked list over a slab).

use crate::table::U64Map;

const NIL: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Node {
    own: u64,
    engine: u64,
    last_s: f64,
    prev: u32,
    next: u32,
}

#[derive(Clone, Debug)]
pub struct Lru {
    index: U64Map<u32>,
    nodes: Vec<Node>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
}

impl Default for Lru {
    fn default() -> Self {
        Self {
            index: U64Map::default(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }
}

impl Lru {
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    pub fn contains(&self, own: u64) -> bool {
        self.index.contains_key(&own)
    }

    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// Appends a block as the most recent (the caller knows it is absent).
    pub fn push_back(&mut self, own: u64, engine: u64, last_s: f64) {
        let node = Node {
            own,
            engine,
            last_s,
            prev: self.tail,
            next: NIL,
        };
        let at = match self.free.pop() {
            Some(at) => {
                self.nodes[at as usize] = node;
                at
            }
            None => {
                self.nodes.push(node);
                u32::try_from(self.nodes.len() - 1).expect("LRU holds fewer than 2^32 blocks")
            }
        };
        if self.tail == NIL {
            self.head = at;
        } else {
            self.nodes[self.tail as usize].next = at;
        }
        self.tail = at;
        self.index.insert(own, at);
    }

    /// Removes a block; returns its engine hash and time.
    pub fn remove(&mut self, own: u64) -> Option<(u64, f64)> {
        let at = self.index.remove(&own)?;
        let node = self.nodes[at as usize];
        if node.prev == NIL {
            self.head = node.next;
        } else {
            self.nodes[node.prev as usize].next = node.next;
        }
        if node.next == NIL {
            self.tail = node.prev;
        } else {
            self.nodes[node.next as usize].prev = node.prev;
        }
        self.free.push(at);
        if self.index.is_empty() {
            self.clear();
        }
        Some((node.engine, node.last_s))
    }

    pub fn set_engine(&mut self, own: u64, engine: u64) -> bool {
        match self.index.get(&own) {
            Some(&at) => {
                self.nodes[at as usize].engine = engine;
                true
            }
            None => false,
        }
    }

    /// Stored blocks (Python `Worker.touch`): each becomes the most recent, in the order of
    /// their first occurrence; the engine hash kept is the last one given for the block.
    pub fn touch(&mut self, hashes: &[u64], owns: &[u64], now_s: f64) {
        for &own in owns {
            self.remove(own);
        }
        for (&engine, &own) in hashes.iter().zip(owns) {
            if !self.set_engine(own, engine) {
                self.push_back(own, engine, now_s);
            }
        }
    }

    /// Forgets blocks; returns the engine hash of the last one (None if it was absent).
    pub fn untouch(&mut self, owns: &[u64]) -> Option<u64> {
        let mut engine = None;
        for &own in owns {
            engine = self.remove(own).map(|(e, _)| e);
        }
        engine
    }

    /// A lookup used these blocks: those still held become the most recent.
    pub fn refresh(&mut self, owns: &[u64], now_s: f64) {
        let mut held = Vec::new();
        for &own in owns {
            if let Some((engine, _)) = self.remove(own) {
                held.push((own, engine));
            }
        }
        for (own, engine) in held {
            self.push_back(own, engine, now_s);
        }
    }

    /// Oldest first: (own, engine, last_s).
    pub fn iter(&self) -> LruIter<'_> {
        LruIter {
            lru: self,
            at: self.head,
        }
    }
}

pub struct LruIter<'a> {
    lru: &'a Lru,
    at: u32,
}

impl Iterator for LruIter<'_> {
    type Item = (u64, u64, f64);

    fn next(&mut self) -> Option<Self::Item> {
        if self.at == NIL {
            return None;
        }
        let node = &self.lru.nodes[self.at as usize];
        self.at = node.next;
        Some((node.own, node.engine, node.last_s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(lru: &Lru) -> Vec<u64> {
        lru.iter().map(|(own, _, _)| own).collect()
    }

    #[test]
    fn touch_moves_to_the_end_in_first_occurrence_order() {
        let mut lru = Lru::default();
        lru.touch(&[10, 20, 30], &[1, 2, 3], 0.0);
        lru.touch(&[11, 12, 13], &[2, 1, 2], 1.0);
        assert_eq!(order(&lru), vec![3, 2, 1]);
        let engines: Vec<u64> = lru.iter().map(|(_, e, _)| e).collect();
        assert_eq!(engines, vec![30, 13, 12]);
        assert_eq!(lru.untouch(&[2, 9]), None);
        assert_eq!(lru.untouch(&[1]), Some(12));
        assert_eq!(order(&lru), vec![3]);
        lru.refresh(&[7, 3], 5.0);
        assert_eq!(lru.iter().next(), Some((3, 30, 5.0)));
        lru.push_back(4, 40, 6.0);
        lru.refresh(&[3], 7.0);
        assert_eq!(order(&lru), vec![4, 3]);
        assert_eq!(lru.len(), 2);
    }
}
