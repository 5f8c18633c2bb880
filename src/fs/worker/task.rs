//! The blocking file steps the fs tier's I/O threads run: a store's temporary file (with its
//! CRC record) and its publication, a load's open, size check and CRC check.

use std::path::PathBuf;

use super::Shared;
use crate::error::{Error, ErrorKind, Result};
use crate::fs::chunk_file::{self, LoadFile, Published, discard_temp};
use crate::fs::config::{FsSync, Integrity};
use crate::fs::integrity::CrcRecord;
use crate::key::ChunkKey;

/// Blocking file work for an I/O thread.
pub(super) enum Task {
    OpenStore {
        tag: u64,
        dest: PathBuf,
        row: u32,
    },
    OpenLoad {
        tag: u64,
        path: PathBuf,
        row: u32,
    },
    FinishStore {
        tag: u64,
        file: usize,
        tmp: PathBuf,
        dest: PathBuf,
        io: Result<usize>,
    },
    FinishLoad {
        tag: u64,
        file: usize,
        path: PathBuf,
        record: Option<CrcRecord>,
        identity: (u64, u64),
        row: u32,
        io: Result<usize>,
        /// The CRC-32 of the bytes the engine's staging copy put in the row, when it staged
        /// the read (`IoCompletion::row_crc`): the row need not be read and hashed again.
        row_crc: Option<u32>,
    },
    Evict {
        key: ChunkKey,
        path: PathBuf,
    },
}

/// What an open step leaves for the finish step.
pub(super) enum Opened {
    Store {
        tmp: PathBuf,
        dest: PathBuf,
    },
    Load {
        path: PathBuf,
        record: Option<CrcRecord>,
        identity: (u64, u64),
        row: u32,
    },
}

/// How a key ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum KeyOutcome {
    /// The store published this file, or found another writer's file there meanwhile.
    Stored(Published),
    /// A complete file was there before the store started: nothing was written.
    Present,
    /// The load's bytes are in the row; `verified` when a CRC record matched.
    Loaded { verified: bool },
}

/// What an I/O thread reports.
pub(super) enum Step {
    /// The file is open and attached as engine file `file`: the row moves next.
    Opened { tag: u64, file: usize, then: Opened },
    /// The key is finished.
    Finished {
        tag: u64,
        outcome: Result<KeyOutcome>,
    },
    /// An eviction's unlink returned.
    Evicted {
        key: ChunkKey,
        result: std::io::Result<()>,
    },
}

/// Runs one task on an I/O thread.
pub(super) fn run_task(sh: &Shared, task: Task) -> Step {
    match task {
        Task::OpenStore { tag, dest, row } => match open_store(sh, &dest, row) {
            Ok(None) => Step::Finished {
                tag,
                outcome: Ok(KeyOutcome::Present),
            },
            Ok(Some((file, tmp))) => Step::Opened {
                tag,
                file,
                then: Opened::Store { tmp, dest },
            },
            Err(e) => Step::Finished {
                tag,
                outcome: Err(e),
            },
        },
        Task::OpenLoad { tag, path, row } => match open_load(sh, &path) {
            Ok((file, record, identity)) => Step::Opened {
                tag,
                file,
                then: Opened::Load {
                    path,
                    record,
                    identity,
                    row,
                },
            },
            Err(e) => Step::Finished {
                tag,
                outcome: Err(e),
            },
        },
        Task::FinishStore {
            tag,
            file,
            tmp,
            dest,
            io,
        } => Step::Finished {
            tag,
            outcome: finish_store(sh, file, &tmp, &dest, io).map(KeyOutcome::Stored),
        },
        Task::FinishLoad {
            tag,
            file,
            path,
            record,
            identity,
            row,
            io,
            row_crc,
        } => Step::Finished {
            tag,
            outcome: finish_load(sh, file, &path, record, identity, (row, row_crc), io),
        },
        Task::Evict { key, path } => Step::Evicted {
            key,
            result: std::fs::remove_file(&path),
        },
    }
}

/// `None` when a complete file is there already; else the attached temporary file.
fn open_store(sh: &Shared, dest: &std::path::Path, row: u32) -> Result<Option<(usize, PathBuf)>> {
    if chunk_file::check_existing(dest, sh.stride()) {
        return Ok(None);
    }
    let record = match sh.integrity {
        Integrity::Xattr => {
            // The manager pinned this row for the job until it is reported, which
            // happens only after this step: nothing writes it meanwhile.
            let bytes = sh.region.read_row(row as usize)?;
            Some(CrcRecord::of(&bytes))
        }
        Integrity::None => None,
    };
    let (file, tmp) = chunk_file::create_temp(dest, sh.direct, &sh.dirs, record)?;
    match sh
        .engine
        .attach_file(file, tmp.display().to_string(), sh.direct)
    {
        Ok(id) => Ok(Some((id, tmp))),
        Err(e) => {
            discard_temp(&tmp);
            Err(e)
        }
    }
}

/// The attached file, its CRC record and its identity.
fn open_load(
    sh: &Shared,
    path: &std::path::Path,
) -> Result<(usize, Option<CrcRecord>, (u64, u64))> {
    let LoadFile {
        file,
        record,
        identity,
    } = chunk_file::open_for_load(path, sh.stride(), sh.direct)?;
    let id = sh
        .engine
        .attach_file(file, path.display().to_string(), sh.direct)?;
    Ok((id, record, identity))
}

fn finish_store(
    sh: &Shared,
    file: usize,
    tmp: &std::path::Path,
    dest: &std::path::Path,
    io: Result<usize>,
) -> Result<Published> {
    let synced = match (&io, sh.fsync) {
        (Ok(_), FsSync::Always) => sh.engine.sync_data(file),
        _ => Ok(()),
    };
    let detached = sh.engine.detach_file(file);
    let outcome = io.and(synced).and(detached.map(drop));
    if let Err(e) = outcome {
        discard_temp(tmp);
        return Err(e);
    }
    let published = chunk_file::publish(tmp, dest, sh.publish)?;
    if sh.fsync == FsSync::Always
        && let Some(dir) = dest.parent()
    {
        crate::g3::dirs::sync_dir(dir)?;
    }
    Ok(published)
}

fn finish_load(
    sh: &Shared,
    file: usize,
    path: &std::path::Path,
    record: Option<CrcRecord>,
    identity: (u64, u64),
    (row, row_crc): (u32, Option<u32>),
    io: Result<usize>,
) -> Result<KeyOutcome> {
    let detached = sh.engine.detach_file(file);
    io?;
    detached?;
    let Some(rec) = record else {
        return Ok(KeyOutcome::Loaded { verified: false });
    };
    let found = match row_crc {
        // The staging copy checksummed the whole row (the read is one row) as it filled it.
        Some(crc) => crc,
        // The row is reserved for this job until it is reported (after this step), and
        // the engine's write into it has completed: nothing else writes it now.
        None => crc32fast::hash(&sh.region.read_row(row as usize)?),
    };
    if found == rec.crc {
        return Ok(KeyOutcome::Loaded { verified: true });
    }
    // A corrupt file: remove it (unless another host replaced it meanwhile) so that no host
    // keeps trying it.
    let removed = chunk_file::remove_if_same(path, identity);
    Err(Error::new(
        ErrorKind::Checksum,
        format!("chunk file {} failed its CRC32 check", path.display()),
    )
    .with("path", path.display().to_string())
    .with("expected", format!("{:08x}", rec.crc))
    .with("found", format!("{found:08x}"))
    .with("removed", removed.to_string()))
}
