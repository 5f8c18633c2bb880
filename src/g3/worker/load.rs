//! The load half of the worker: pinning slots, CRC check after the read, and turning every
//! failed key into a miss.

use std::sync::atomic::Ordering;

use super::{Active, KeyStatus, Worker};
use crate::error::{Error, ErrorKind};
use crate::g3::record::{chunk_crc, chunk_crc_from_row_crc};
use crate::region::mem_hints::evict_from_caches;

/// Loaded rows up to this size leave the CPU caches once their CRC is checked
/// ([`evict_from_caches`]). Measured on this project's VM, 64 KiB-row loads at depth 32 ran
/// 1.74 against 1.27 GB/s and 256 KiB rows 2.56 against 1.91; from 512 KiB no gain, and at
/// 16 MiB the flush cost more than it saved (`docs/performance.md`, "Small rows").
const EVICT_CHECKED_ROWS_UP_TO: u64 = 256 << 10;

impl Worker {
    pub(super) fn prepare_load(&mut self, a: &mut Active) {
        let mut guard = self.sh.index.lock();
        let Some(ix) = guard.as_mut() else { return };
        for i in 0..a.keys.len() {
            if a.tier.grant.is_none()
                && let Err(e) = self.check_row(a.rows[i])
            {
                a.fail(i, e);
                continue;
            }
            match ix.pin(&a.keys[i]) {
                Some(sc) => a.tier.slots[i] = Some(sc),
                None => a.fail(
                    i,
                    Error::new(
                        ErrorKind::Internal,
                        format!("key {} is not held by this tier", a.keys[i]),
                    )
                    .with("key", a.keys[i].to_hex()),
                ),
            }
        }
    }

    pub(super) fn finish_load(&mut self, mut a: Active) {
        let region = self.engine.region();
        let stride = self.set.row_stride();
        let mut dropped = Vec::new();
        let mut loaded = Vec::new();
        // CRCs first, without the index lock (lookups must not wait on hashing).
        for i in 0..a.keys.len() {
            let Some((slot, crc)) = a.tier.slots[i] else {
                continue;
            };
            if a.status[i] != KeyStatus::Done {
                continue;
            }
            let found = match &a.tier.grant {
                // The other data path checksummed the row it read (see `grants.rs`).
                Some(d) => Ok(chunk_crc_from_row_crc(
                    a.keys[i].as_bytes(),
                    d.crcs[i],
                    stride,
                )),
                // The engine's staging copy checksummed the bytes it put in the row.
                None if a.tier.row_crcs.get(i).copied().flatten().is_some() => {
                    Ok(chunk_crc_from_row_crc(
                        a.keys[i].as_bytes(),
                        a.tier.row_crcs[i].unwrap_or_default(),
                        stride,
                    ))
                }
                // The manager reserves a load job's rows (no other reader or writer)
                // until the job is reported; our read into the row has completed.
                None => region.read_row(a.rows[i] as usize).map(|row| {
                    let loaded = &row[..(stride as usize).min(row.len())];
                    let crc = chunk_crc(a.keys[i].as_bytes(), loaded);
                    if stride <= EVICT_CHECKED_ROWS_UP_TO {
                        evict_from_caches(loaded);
                    }
                    crc
                }),
            };
            match found {
                Ok(found) if found == crc => loaded.push(a.keys[i].clone()),
                Ok(found) => {
                    self.sh
                        .metrics
                        .checksum_failures
                        .fetch_add(1, Ordering::Relaxed);
                    let e = Error::new(
                        ErrorKind::Checksum,
                        format!("G3 slot {slot} failed its CRC check for key {}", a.keys[i]),
                    )
                    .with("key", a.keys[i].to_hex())
                    .with("expected", format!("{crc:08x}"))
                    .with("found", format!("{found:08x}"));
                    log::warn!("{e}");
                    a.fail(i, e);
                }
                Err(e) => a.fail(i, e),
            }
        }
        {
            let mut guard = self.sh.index.lock();
            if let Some(ix) = guard.as_mut() {
                for i in 0..a.keys.len() {
                    let Some((slot, _)) = a.tier.slots[i] else {
                        continue;
                    };
                    // A key whose destination was lost (not its slot) stays.
                    let kept = a.tier.grant.as_ref().is_some_and(|d| d.keep[i]);
                    if a.status[i] == KeyStatus::Failed
                        && !kept
                        && let Some(k) = ix.drop_slot(slot)
                    {
                        dropped.push((k, slot));
                    }
                    ix.unpin(slot);
                }
                self.refresh_slot_gauges(ix);
            }
        }
        // A failed key becomes a miss at once and its slot is released (no promotion
        // livelock); the removal is journaled.
        self.journal_removals(dropped);
        let m = &self.sh.metrics;
        m.keys_loaded
            .fetch_add(loaded.len() as u64, Ordering::Relaxed);
        let failed = a.count(KeyStatus::Failed);
        m.key_failures.fetch_add(failed as u64, Ordering::Relaxed);
        self.report(a, Some(loaded));
    }
}
