//! The status document (`STATUS`, `kvtier service status`).

use std::sync::atomic::Ordering;

use super::shared::ServiceShared;
use crate::contract::secondary::SecondaryTier;

/// The status document (`STATUS`, `kvtier service status`).
pub fn status_json(sh: &ServiceShared) -> String {
    let tier = sh.tier.lock();
    let info = tier.info();
    let doc = serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "digest": hex::encode(sh.digest),
        "row_stride": sh.row_stride,
        "slot_bytes": sh.slot_bytes,
        "tier": {
            "paths": info.slab_paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
            "total_slots": info.total_slots,
            "used_slots": tier.len(),
            // Transfers started and not finished: each holds pins (load) or reserved slots.
            "active_transfers": tier
                .metrics()
                .iter()
                .find(|m| m.name == "g3_active_jobs")
                .map_or(0.0, |m| m.value),
            "engine": info.engine,
            "ready": tier.is_recovered(),
        },
        "staging": sh.staging.as_ref().map(|st| {
            let c = &st.pool.counters;
            let n = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
            serde_json::json!({
                "slots": st.pool.num_slots(),
                "used_slots": st.pool.used_slots(),
                "held_slots": st.pool.held_slots(),
                "hits": n(&c.hits),
                "g3_loads": n(&c.g3_loads),
                "evictions": n(&c.evictions),
                "discarded": n(&c.discarded),
                "prefetched": n(&st.counters.staged),
                "g3_touches": n(&st.counters.g3_touches),
            })
        }),
        "event_subscribers": sh.events.subscribers(),
        "engines": sh.engines.status(),
        "refused_connections": sh.engines.refused.load(Ordering::Relaxed),
        "cancelled_jobs": sh.engines.cancelled_jobs.load(Ordering::Relaxed),
        "disconnects": sh.engines.disconnects.load(Ordering::Relaxed),
        "test_hold": sh.hooks.status(),
        "regions_lost": sh.engines.regions_lost.load(Ordering::Relaxed),
        "last_region_lost": sh.engines.last_region_lost.lock().clone(),
    });
    doc.to_string()
}
