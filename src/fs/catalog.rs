//! The chunk files this process knows about under the tier's folder (stored by it, seen by a
//! lookup or a load, or found by the start-up scan), in least-recently-used order, with their
//! bytes. Eviction takes the least recently used files that no load of this process holds
//! until the known bytes fit the capacity. Every operation is O(1) except eviction, which is
//! O(1) per file taken.

use std::collections::HashMap;

use crate::key::ChunkKey;

const NIL: u32 = u32::MAX;

#[derive(Debug)]
struct Node {
    key: ChunkKey,
    bytes: u64,
    /// Loads of this process reading the file: it is not evicted while any runs.
    pins: u32,
    prev: u32,
    next: u32,
}

/// Known chunk files, most recently used first.
#[derive(Debug)]
pub struct Catalog {
    map: HashMap<ChunkKey, u32>,
    nodes: Vec<Option<Node>>,
    free: Vec<u32>,
    /// Most recently used.
    head: u32,
    /// Least recently used.
    tail: u32,
    bytes: u64,
    capacity: u64,
}

impl Catalog {
    /// An empty catalog that evicts above `capacity` bytes.
    pub fn new(capacity: u64) -> Self {
        Catalog {
            map: HashMap::new(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            bytes: 0,
            capacity,
        }
    }

    /// Files known.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when no file is known.
    #[cfg(any(test, feature = "test-support"))]
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Bytes of the files known.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The capacity in bytes.
    #[cfg(any(test, feature = "test-support"))]
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Whether `key`'s file is known (without changing its recency).
    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.map.contains_key(key)
    }

    /// Makes `key` the most recently used; false if it is not known.
    pub fn touch(&mut self, key: &ChunkKey) -> bool {
        match self.map.get(key) {
            Some(&i) => {
                self.unlink(i);
                self.push_front(i);
                true
            }
            None => false,
        }
    }

    /// Records `key`'s file of `bytes` as the most recently used.
    pub fn insert(&mut self, key: ChunkKey, bytes: u64) {
        if let Some(&i) = self.map.get(&key) {
            self.set_bytes(i, bytes);
            self.unlink(i);
            self.push_front(i);
            return;
        }
        let i = self.alloc(key.clone(), bytes);
        self.map.insert(key, i);
        self.push_front(i);
    }

    /// Records a file found by the scan as the least recently used, unless it is known
    /// already (what this process did since it started is more recent). Insert the scan's
    /// files newest first. True if it was added.
    pub fn insert_cold(&mut self, key: ChunkKey, bytes: u64) -> bool {
        if self.map.contains_key(&key) {
            return false;
        }
        let i = self.alloc(key.clone(), bytes);
        self.map.insert(key, i);
        self.push_back(i);
        true
    }

    /// Forgets `key`'s file; false if it was not known.
    pub fn remove(&mut self, key: &ChunkKey) -> bool {
        match self.map.remove(key) {
            Some(i) => {
                self.unlink(i);
                self.release(i);
                true
            }
            None => false,
        }
    }

    /// Holds `key`'s file against eviction (a load reads it); false if it is not known.
    pub fn pin(&mut self, key: &ChunkKey) -> bool {
        match self.node_mut(key) {
            Some(n) => {
                n.pins += 1;
                true
            }
            None => false,
        }
    }

    /// Ends one [`Catalog::pin`].
    pub fn unpin(&mut self, key: &ChunkKey) {
        if let Some(n) = self.node_mut(key) {
            n.pins = n.pins.saturating_sub(1);
        }
    }

    /// Forgets and returns the least recently used files that are not pinned until the known
    /// bytes fit the capacity (fewer if only pinned files are left).
    pub fn take_victims(&mut self) -> Vec<ChunkKey> {
        let mut out = Vec::new();
        let mut i = self.tail;
        while self.bytes > self.capacity && i != NIL {
            let Some(n) = self.nodes[i as usize].as_ref() else {
                break;
            };
            let prev = n.prev;
            if n.pins == 0 {
                let key = n.key.clone();
                self.map.remove(&key);
                self.unlink(i);
                self.release(i);
                out.push(key);
            }
            i = prev;
        }
        out
    }

    /// Keys from least to most recently used (for tests and tools).
    #[cfg(any(test, feature = "test-support"))]
    pub fn keys_lru_first(&self) -> Vec<ChunkKey> {
        let mut out = Vec::with_capacity(self.len());
        let mut i = self.tail;
        while i != NIL {
            let Some(n) = self.nodes[i as usize].as_ref() else {
                break;
            };
            out.push(n.key.clone());
            i = n.prev;
        }
        out
    }

    fn node_mut(&mut self, key: &ChunkKey) -> Option<&mut Node> {
        let i = *self.map.get(key)?;
        self.nodes[i as usize].as_mut()
    }

    fn set_bytes(&mut self, i: u32, bytes: u64) {
        if let Some(n) = self.nodes[i as usize].as_mut() {
            self.bytes = self.bytes - n.bytes + bytes;
            n.bytes = bytes;
        }
    }

    fn alloc(&mut self, key: ChunkKey, bytes: u64) -> u32 {
        self.bytes += bytes;
        let node = Node {
            key,
            bytes,
            pins: 0,
            prev: NIL,
            next: NIL,
        };
        match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = Some(node);
                i
            }
            None => {
                self.nodes.push(Some(node));
                (self.nodes.len() - 1) as u32
            }
        }
    }

    fn release(&mut self, i: u32) {
        if let Some(n) = self.nodes[i as usize].take() {
            self.bytes -= n.bytes;
            self.free.push(i);
        }
    }

    fn links(&self, i: u32) -> (u32, u32) {
        self.nodes[i as usize]
            .as_ref()
            .map_or((NIL, NIL), |n| (n.prev, n.next))
    }

    fn set_prev(&mut self, i: u32, prev: u32) {
        if let Some(n) = self.nodes[i as usize].as_mut() {
            n.prev = prev;
        }
    }

    fn set_next(&mut self, i: u32, next: u32) {
        if let Some(n) = self.nodes[i as usize].as_mut() {
            n.next = next;
        }
    }

    fn unlink(&mut self, i: u32) {
        let (prev, next) = self.links(i);
        if prev == NIL {
            if self.head == i {
                self.head = next;
            }
        } else {
            self.set_next(prev, next);
        }
        if next == NIL {
            if self.tail == i {
                self.tail = prev;
            }
        } else {
            self.set_prev(next, prev);
        }
        self.set_prev(i, NIL);
        self.set_next(i, NIL);
    }

    fn push_front(&mut self, i: u32) {
        self.set_next(i, self.head);
        self.set_prev(i, NIL);
        if self.head != NIL {
            self.set_prev(self.head, i);
        }
        self.head = i;
        if self.tail == NIL {
            self.tail = i;
        }
    }

    fn push_back(&mut self, i: u32) {
        self.set_prev(i, self.tail);
        self.set_next(i, NIL);
        if self.tail != NIL {
            self.set_next(self.tail, i);
        }
        self.tail = i;
        if self.head == NIL {
            self.head = i;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u8) -> ChunkKey {
        ChunkKey::new([i; 8])
    }

    fn order(c: &Catalog) -> Vec<u8> {
        c.keys_lru_first().iter().map(|k| k.as_bytes()[0]).collect()
    }

    #[test]
    fn lru_order_touch_and_cold_inserts() {
        let mut c = Catalog::new(100);
        c.insert(k(1), 10);
        c.insert(k(2), 10);
        c.insert(k(3), 10);
        assert_eq!(order(&c), [1, 2, 3]);
        assert!(c.touch(&k(1)));
        assert_eq!(order(&c), [2, 3, 1]);
        // Scan results go behind everything, newest first.
        assert!(c.insert_cold(k(9), 10));
        assert!(c.insert_cold(k(8), 10));
        assert!(!c.insert_cold(k(2), 10));
        assert_eq!(order(&c), [8, 9, 2, 3, 1]);
        assert_eq!(c.bytes(), 50);
        c.insert(k(9), 30);
        assert_eq!(c.bytes(), 70);
        assert_eq!(order(&c), [8, 2, 3, 1, 9]);
        assert!(c.remove(&k(3)));
        assert!(!c.remove(&k(3)));
        assert_eq!(order(&c), [8, 2, 1, 9]);
        assert_eq!((c.len(), c.bytes()), (4, 60));
    }

    #[test]
    fn eviction_skips_pinned_files_and_stops_when_it_fits() {
        let mut c = Catalog::new(25);
        for i in 1..=5 {
            c.insert(k(i), 10);
        }
        assert!(c.pin(&k(1)));
        assert!(!c.pin(&k(7)));
        let v = c.take_victims();
        assert_eq!(v, vec![k(2), k(3), k(4)]);
        assert_eq!(order(&c), [1, 5]);
        assert_eq!(c.bytes(), 20);
        c.insert(k(6), 10);
        assert_eq!(c.take_victims(), vec![k(5)]);
        c.unpin(&k(1));
        c.insert(k(7), 10);
        assert_eq!(c.take_victims(), vec![k(1)]);
        assert_eq!(order(&c), [6, 7]);
        assert!(c.take_victims().is_empty());
    }

    #[test]
    fn everything_pinned_takes_nothing() {
        let mut c = Catalog::new(5);
        c.insert(k(1), 10);
        c.pin(&k(1));
        assert!(c.take_victims().is_empty());
        assert_eq!(c.len(), 1);
        // Node slots are reused after removal.
        c.remove(&k(1));
        c.insert(k(2), 1);
        assert_eq!(c.nodes.len(), 1);
    }
}
