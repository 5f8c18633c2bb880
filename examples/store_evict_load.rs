//! Stores a chunk through kvtier's tiering manager into a G3 (NVMe) tier, evicts it from the
//! primary region by storing others, then loads it back (the tier promotes it into a primary
//! row) and checks every byte:
//!
//! ```sh
//! cargo run --example store_evict_load [DIR]    # DIR: where the tier's slab goes (default: $TMPDIR)
//! ```
//!
//! The program plays both the inference server's scheduler (requests, lookups, step ends) and
//! its GPU worker (it writes a chunk's bytes into the row the manager hands out).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvtier::{Builder, ChunkKey, LookupResult, RequestContext, ScheduleEndContext, TieringManager};

/// Rows of the primary region (the default layout's rows are 2 MiB: 4 rows in 8 MiB).
const PRIMARY_ROWS: u8 = 4;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let parent = std::env::args_os()
        .nth(1)
        .map_or_else(std::env::temp_dir, PathBuf::from);
    let dir = tempfile::Builder::new()
        .prefix("kvtier-example-")
        .tempdir_in(&parent)?;
    let config = serde_json::json!({
        "cpu_bytes_to_use": "8MiB",
        "secondary_tiers": [{"type": "nvme", "paths": [dir.path()], "capacity_bytes": "64MiB"}],
    });
    // Llama-3.1-8B at TP 1 sizes the rows (2 MiB per chunk of one block).
    let mut manager = Builder::from_json(&config.to_string())?
        .layout(kvtier::canonical::default_layout(), 1)
        .build()?;

    let chunk = ChunkKey::new(b"the prefix of a long prompt");
    let req = RequestContext::new("request-1");
    manager.on_new_request(&req);
    store(&mut manager, &req, &chunk)?;
    settle(&mut manager)?; // the cascade into the G3 tier is reported
    for i in 0..PRIMARY_ROWS {
        store(&mut manager, &req, &ChunkKey::new([i]))?;
        settle(&mut manager)?;
    }
    manager.on_request_finished(&req);
    println!("stored {chunk} and evicted it from the primary");

    let req = RequestContext::new("request-2");
    manager.on_new_request(&req);
    let first = manager.lookup(&chunk, &req);
    assert_eq!(
        first,
        LookupResult::HitPending,
        "the G3 tier should hold it"
    );
    settle(&mut manager)?; // the step end submits the promotion; the tier loads the row
    assert_eq!(manager.lookup(&chunk, &req), LookupResult::Hit);
    let rows = manager.prepare_load(std::slice::from_ref(&chunk), &req)?;
    // Prepare_load pinned the row for this reader; nothing writes it until
    // complete_load.
    let loaded = manager.region().read_row(rows[0] as usize)?.to_vec();
    assert!(loaded == contents(&chunk, loaded.len()), "bytes differ");
    manager.complete_load(std::slice::from_ref(&chunk))?;
    manager.on_request_finished(&req);
    println!(
        "loaded it back from the G3 tier: {} bytes, all equal",
        loaded.len()
    );
    manager.shutdown()?;
    Ok(())
}

/// A chunk's bytes: a pattern made from its key.
fn contents(key: &ChunkKey, len: usize) -> Vec<u8> {
    let seed = key.as_bytes();
    (0..len).map(|i| seed[i % seed.len()] ^ (i as u8)).collect()
}

/// The inference server's GPU -> primary store of one chunk.
fn store(m: &mut TieringManager, req: &RequestContext, key: &ChunkKey) -> kvtier::Result<()> {
    let out = m
        .prepare_store(std::slice::from_ref(key), req)
        .expect("the primary has an evictable row");
    for (k, row) in out.keys_to_store.iter().zip(&out.chunk_ids) {
        let region = m.region().clone();
        // Prepare_store reserved the row for this writer (ref count -1): nobody else
        // reads or writes it until complete_store.
        let mut dst = region.write_row(*row as usize)?;
        let bytes = contents(k, dst.len());
        dst.copy_from_slice(&bytes);
    }
    m.complete_store(&out.keys_to_store, req, true);
    Ok(())
}

/// Steps until no transfer is outstanding.
fn settle(m: &mut TieringManager) -> kvtier::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        m.on_schedule_end(&ScheduleEndContext::default())?;
        if !m.has_pending_work() {
            return Ok(());
        }
        assert!(
            Instant::now() < deadline,
            "transfers still pending after 60 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}
