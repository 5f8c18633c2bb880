//! Index-based intrusive doubly linked lists over a shared array of links.
//!
//! Node `i` owns `links[i]`; a node is in at most one list at a time, so several lists (T1,
//! T2, the set-aside list, ghost lists) can share one array. Every operation is O(1) and
//! allocates nothing. The front is the most recently used end, the back the least recently
//! used end.

/// "No node".
pub(crate) const NIL: u32 = u32::MAX;

/// Previous / next node of one node (NIL at the ends).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Link {
    pub(crate) prev: u32,
    pub(crate) next: u32,
}

impl Link {
    pub(crate) const UNLINKED: Link = Link {
        prev: NIL,
        next: NIL,
    };
}

/// A fresh array of `n` unlinked nodes.
pub(crate) fn new_links(n: usize) -> Box<[Link]> {
    crate::primary::huge_arrays::huge_slice(n, || Link::UNLINKED)
}

/// The node after `i` walking from the back (least recent) to the front: its more recent
/// neighbour, `None` at the front.
pub(crate) fn more_recent(links: &[Link], i: u32) -> Option<u32> {
    let p = links[i as usize].prev;
    (p != NIL).then_some(p)
}

/// Starts loading node `slot`'s links and its per-slot policy state (out-of-range: nothing).
pub(crate) fn prefetch_node(links: &[Link], state: &[u8], slot: u32) {
    if let (Some(link), Some(st)) = (links.get(slot as usize), state.get(slot as usize)) {
        crate::primary::huge_arrays::prefetch(link);
        crate::primary::huge_arrays::prefetch(st);
    }
}

/// The ends and length of one list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct List {
    head: u32,
    tail: u32,
    len: usize,
}

impl Default for List {
    fn default() -> Self {
        List {
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }
}

impl List {
    /// Number of nodes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Most recently used node.
    #[cfg(test)]
    pub(crate) fn front(&self) -> Option<u32> {
        (self.head != NIL).then_some(self.head)
    }

    /// Least recently used node.
    pub(crate) fn back(&self) -> Option<u32> {
        (self.tail != NIL).then_some(self.tail)
    }

    /// Links the unlinked node `i` at the front (most recent).
    pub(crate) fn push_front(&mut self, links: &mut [Link], i: u32) {
        links[i as usize] = Link {
            prev: NIL,
            next: self.head,
        };
        if self.head == NIL {
            self.tail = i;
        } else {
            links[self.head as usize].prev = i;
        }
        self.head = i;
        self.len += 1;
    }

    /// Moves node `i` (in this list) to the front.
    pub(crate) fn move_to_front(&mut self, links: &mut [Link], i: u32) {
        if self.head != i {
            self.unlink(links, i);
            self.push_front(links, i);
        }
    }

    /// Links the unlinked node `i` at the back (least recent).
    #[cfg(test)]
    pub(crate) fn push_back(&mut self, links: &mut [Link], i: u32) {
        links[i as usize] = Link {
            prev: self.tail,
            next: NIL,
        };
        if self.tail == NIL {
            self.head = i;
        } else {
            links[self.tail as usize].next = i;
        }
        self.tail = i;
        self.len += 1;
    }

    /// Unlinks node `i`, which must be in this list.
    pub(crate) fn unlink(&mut self, links: &mut [Link], i: u32) {
        let Link { prev, next } = links[i as usize];
        if prev == NIL {
            self.head = next;
        } else {
            links[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            links[next as usize].prev = prev;
        }
        links[i as usize] = Link::UNLINKED;
        self.len -= 1;
    }

    /// Unlinks and returns the back node.
    #[cfg(test)]
    pub(crate) fn pop_back(&mut self, links: &mut [Link]) -> Option<u32> {
        let i = self.back()?;
        self.unlink(links, i);
        Some(i)
    }

    /// Nodes from front (most recent) to back (least recent). O(len): diagnostics only.
    pub(crate) fn iter<'a>(&self, links: &'a [Link]) -> impl Iterator<Item = u32> + 'a {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let i = cur;
            cur = links[i as usize].next;
            Some(i)
        })
    }

    /// Forgets every node (the caller resets the links).
    pub(crate) fn clear(&mut self) {
        *self = List::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_unlink_pop_keep_order() {
        let mut links = new_links(5);
        let mut l = List::default();
        l.push_front(&mut links, 0);
        l.push_front(&mut links, 1);
        l.push_back(&mut links, 2);
        l.push_front(&mut links, 3);
        assert_eq!(l.iter(&links).collect::<Vec<_>>(), vec![3, 1, 0, 2]);
        l.unlink(&mut links, 1);
        assert_eq!(l.iter(&links).collect::<Vec<_>>(), vec![3, 0, 2]);
        assert_eq!(l.pop_back(&mut links), Some(2));
        assert_eq!(l.pop_back(&mut links), Some(0));
        assert_eq!(l.front(), Some(3));
        assert_eq!(l.back(), Some(3));
        assert_eq!(l.len(), 1);
        assert_eq!(l.pop_back(&mut links), Some(3));
        assert_eq!(l.pop_back(&mut links), None);
        assert!(links.iter().all(|k| *k == Link::UNLINKED));
    }
}
