//! The service's inventory events: which medium holds which keys (the DRAM staging pool,
//! vLLM's `Medium.CPU`; the G3 slots, `Medium.STORAGE`), queued for every engine that asked
//! for them (`TAKE_EVENTS`) until it asks again.
//!
//! Only engines that asked have a queue. A queue holds at most [`MAX_QUEUED_KEYS`] keys; past
//! that its oldest events are dropped and counted (`node_events_dropped_total`), so an engine
//! that stops asking costs bounded memory.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::key::ChunkKey;
use crate::node::protocol::{EventMedium, InventoryEvent};

/// Keys one engine's queue holds at most.
pub const MAX_QUEUED_KEYS: usize = 1 << 18;
/// Keys one `EVENTS` reply carries at most (the rest wait for the next ask).
pub const MAX_KEYS_PER_REPLY: usize = 1 << 16;

#[derive(Debug, Default)]
struct Queue {
    events: VecDeque<InventoryEvent>,
    keys: usize,
}

/// Per-engine event queues (see the module docs).
#[derive(Debug, Default)]
pub struct EventBus {
    queues: Mutex<HashMap<u64, Queue>>,
    /// Events dropped from full queues.
    pub dropped: AtomicU64,
}

impl EventBus {
    /// True when some engine asks for events.
    pub fn has_subscribers(&self) -> bool {
        !self.queues.lock().is_empty()
    }

    /// Engines that ask for events.
    pub fn subscribers(&self) -> usize {
        self.queues.lock().len()
    }

    /// Queues `keys` arriving at (`removed` false) or leaving `medium` for every subscriber.
    pub fn publish(&self, medium: EventMedium, removed: bool, keys: &[ChunkKey]) {
        if keys.is_empty() {
            return;
        }
        let mut queues = self.queues.lock();
        for q in queues.values_mut() {
            // Consecutive events of one kind become one.
            match q.events.back_mut() {
                Some(last) if last.medium == medium && last.removed == removed => {
                    last.keys.extend_from_slice(keys);
                }
                _ => q.events.push_back(InventoryEvent {
                    medium,
                    removed,
                    keys: keys.to_vec(),
                }),
            }
            q.keys += keys.len();
            while q.keys > MAX_QUEUED_KEYS {
                let Some(old) = q.events.pop_front() else {
                    break;
                };
                q.keys -= old.keys.len();
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// The events queued for engine `id` since its last call (at most [`MAX_KEYS_PER_REPLY`]
    /// keys; more wait). The first call subscribes it.
    pub fn take(&self, id: u64) -> Vec<InventoryEvent> {
        let mut queues = self.queues.lock();
        let q = queues.entry(id).or_default();
        let mut out = Vec::new();
        let mut budget = MAX_KEYS_PER_REPLY;
        while let Some(mut e) = q.events.pop_front() {
            if e.keys.len() > budget {
                let rest = e.keys.split_off(budget);
                q.events.push_front(InventoryEvent {
                    medium: e.medium,
                    removed: e.removed,
                    keys: rest,
                });
            }
            budget -= e.keys.len();
            q.keys -= e.keys.len();
            out.push(e);
            if budget == 0 {
                break;
            }
        }
        out
    }

    /// Engine `id` is gone: its queue goes with it.
    pub fn unsubscribe(&self, id: u64) {
        self.queues.lock().remove(&id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: usize) -> ChunkKey {
        ChunkKey::new(format!("k{i}").as_bytes())
    }

    #[test]
    fn only_subscribers_get_events_merged_in_order_and_bounded() {
        let bus = EventBus::default();
        bus.publish(EventMedium::Cpu, false, &[k(0)]);
        assert!(bus.take(1).is_empty(), "nothing before subscribing");
        bus.publish(EventMedium::Cpu, false, &[k(1)]);
        bus.publish(EventMedium::Cpu, false, &[k(2)]);
        bus.publish(EventMedium::Storage, false, &[k(3)]);
        bus.publish(EventMedium::Cpu, true, &[k(1)]);
        let got = bus.take(1);
        assert_eq!(got.len(), 3);
        assert_eq!(got[0].keys, vec![k(1), k(2)]);
        assert_eq!(got[1].medium, EventMedium::Storage);
        assert!(got[2].removed);
        assert!(bus.take(1).is_empty());
        let many: Vec<ChunkKey> = (0..MAX_KEYS_PER_REPLY + 5).map(k).collect();
        bus.publish(EventMedium::Storage, false, &many);
        assert_eq!(bus.take(1)[0].keys.len(), MAX_KEYS_PER_REPLY);
        assert_eq!(bus.take(1)[0].keys.len(), 5);
        for _ in 0..5 {
            bus.publish(EventMedium::Cpu, false, &many);
            bus.publish(EventMedium::Storage, false, &[k(0)]);
        }
        assert!(bus.dropped.load(Ordering::Relaxed) > 0);
        let kept: usize = std::iter::from_fn(|| Some(bus.take(1)))
            .take_while(|v| !v.is_empty())
            .flatten()
            .map(|e| e.keys.len())
            .sum();
        assert!(kept <= MAX_QUEUED_KEYS, "{kept}");
        bus.unsubscribe(1);
        assert!(!bus.has_subscribers());
    }
}
