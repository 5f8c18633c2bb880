//! The executor: moves whole chunks between GPU blocks and G3 slots through device staging
//! rows, with the row CRC computed on the device and checked before a load touches the GPU
//! blocks.
//!
//! Store, per chunk: zero the staging row, copy the chunk's runs from the GPU blocks into it
//! (2-D copies on the device), CRC its [`PIECE_BYTES`](crate::crc::PIECE_BYTES) pieces on the
//! device and compose them on the host, then one file write of the whole row at the slot's
//! offset. Load, per chunk: one file read of the row into a staging row, the same CRC, and only
//! when it equals the indexed CRC the copies from the staging row into the GPU blocks.
//!
//! Chunks go in waves of as many staging rows as `max_bytes_in_flight` allows, their file I/O
//! run concurrently by scoped threads (which end before the staging rows can be reused or
//! freed), so at most that many bytes are ever in flight.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::crc::compose_pieces;
use crate::device::{Device, FileId, Flow};
use crate::error::{GdsError, GdsErrorKind, Result};
use crate::plan::DeviceCopy;

/// Most staging rows (and I/O threads) one executor uses.
pub const MAX_STAGING_ROWS: u64 = 64;

/// Where a chunk's row lives on disk: a registered slab file and the slot's byte offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotLocation {
    /// The slab file.
    pub file: FileId,
    /// Byte offset of the slot in the file.
    pub offset: u64,
}

/// One chunk to store: the copies that assemble its row from GPU blocks, and its slot.
#[derive(Debug, Clone, Copy)]
pub struct StoreChunk<'a> {
    /// Copies GPU blocks -> row (the plan for this chunk).
    pub copies: &'a [DeviceCopy],
    /// Where its row goes.
    pub slot: SlotLocation,
}

/// One chunk to load: the copies from its row into GPU blocks, its slot and indexed CRC.
#[derive(Debug, Clone, Copy)]
pub struct LoadChunk<'a> {
    /// Copies row -> GPU blocks.
    pub copies: &'a [DeviceCopy],
    /// Where its row is.
    pub slot: SlotLocation,
    /// The CRC-32 the index holds for the row.
    pub crc: u32,
}

/// A load's result for one chunk: the CRC found, or why it failed. A chunk whose CRC did not
/// match left its GPU blocks untouched.
pub type LoadOutcome = Result<u32>;

/// Moves chunks between GPU blocks and slots through staging rows on `D`.
pub struct Executor<'d, D: Device> {
    dev: &'d D,
    row_stride: u64,
    staging: Vec<u64>,
}

impl<'d, D: Device> std::fmt::Debug for Executor<'d, D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("row_stride", &self.row_stride)
            .field("staging_rows", &self.staging.len())
            .finish()
    }
}

impl<'d, D: Device> Executor<'d, D> {
    /// An executor for rows of `row_stride` bytes with at most `max_bytes_in_flight` of file
    /// I/O outstanding (at least one row, at most [`MAX_STAGING_ROWS`]).
    pub fn new(dev: &'d D, row_stride: u64, max_bytes_in_flight: u64) -> Result<Self> {
        if row_stride == 0 || !row_stride.is_multiple_of(crate::device::ALIGN as u64) {
            return Err(GdsError::new(
                GdsErrorKind::Plan,
                format!("row stride {row_stride} is not a positive multiple of 4096"),
            ));
        }
        let rows = (max_bytes_in_flight / row_stride).clamp(1, MAX_STAGING_ROWS);
        let mut staging = Vec::with_capacity(rows as usize);
        for _ in 0..rows {
            match dev.alloc(row_stride) {
                Ok(a) => staging.push(a),
                Err(e) => {
                    staging.iter().for_each(|a| dev.free(*a));
                    return Err(e);
                }
            }
        }
        Ok(Executor {
            dev,
            row_stride,
            staging,
        })
    }

    /// Rows moved concurrently (bytes in flight / row stride).
    pub fn rows_in_flight(&self) -> usize {
        self.staging.len()
    }

    /// Stores `chunks`; for each, the CRC-32 of the row written (what the journal records),
    /// or why it failed.
    pub fn store(&self, chunks: &[StoreChunk<'_>]) -> Vec<Result<u32>> {
        let mut out = Vec::with_capacity(chunks.len());
        for wave in chunks.chunks(self.staging.len()) {
            // Assemble and checksum every row of the wave, then write them concurrently.
            let mut crcs: Vec<Result<u32>> = wave
                .iter()
                .zip(&self.staging)
                .map(|(c, &row)| {
                    self.dev.zero(row, self.row_stride)?;
                    self.dev
                        .copy_device_row(row, self.row_stride, c.copies, Flow::ToRow)?;
                    let pieces = self.dev.crc_pieces(row, self.row_stride)?;
                    Ok(compose_pieces(&pieces, self.row_stride))
                })
                .collect();
            let io = self.parallel(wave.len(), |i| match &crcs[i] {
                Ok(_) => {
                    let c = &wave[i];
                    let n = self.dev.write_file(
                        c.slot.file,
                        c.slot.offset,
                        self.staging[i],
                        self.row_stride,
                    )?;
                    self.whole(n, "write")
                }
                Err(_) => Ok(()),
            });
            for (crc, r) in crcs.iter_mut().zip(io) {
                if let (Ok(_), Err(e)) = (&crc, r) {
                    *crc = Err(e);
                }
            }
            out.extend(crcs);
        }
        out
    }

    /// Loads `chunks`: reads each row, checks its CRC, and only then copies it into the GPU
    /// blocks.
    pub fn load(&self, chunks: &[LoadChunk<'_>]) -> Vec<LoadOutcome> {
        let mut out = Vec::with_capacity(chunks.len());
        for wave in chunks.chunks(self.staging.len()) {
            let io = self.parallel(wave.len(), |i| {
                let c = &wave[i];
                let n = self.dev.read_file(
                    c.slot.file,
                    c.slot.offset,
                    self.staging[i],
                    self.row_stride,
                )?;
                self.whole(n, "read")
            });
            for ((c, &row), r) in wave.iter().zip(&self.staging).zip(io) {
                let result = r.and_then(|()| {
                    let pieces = self.dev.crc_pieces(row, self.row_stride)?;
                    let found = compose_pieces(&pieces, self.row_stride);
                    if found != c.crc {
                        return Err(GdsError::new(
                            GdsErrorKind::Checksum,
                            format!(
                                "slot at offset {} failed its CRC check: expected {:08x}, found \
                                 {found:08x}",
                                c.slot.offset, c.crc
                            ),
                        ));
                    }
                    self.dev
                        .copy_device_row(row, self.row_stride, c.copies, Flow::FromRow)?;
                    Ok(found)
                });
                out.push(result);
            }
        }
        out
    }

    fn whole(&self, n: u64, what: &str) -> Result<()> {
        if n == self.row_stride {
            Ok(())
        } else {
            Err(GdsError::new(
                GdsErrorKind::ShortIo,
                format!("slot {what} moved {n} of {} bytes", self.row_stride),
            ))
        }
    }

    /// Runs `f(0..n)` on up to `n` scoped threads (one when `n` is 1) and returns the results
    /// in order. Every thread has ended when this returns.
    fn parallel<F>(&self, n: usize, f: F) -> Vec<Result<()>>
    where
        F: Fn(usize) -> Result<()> + Sync,
    {
        if n <= 1 {
            return (0..n).map(&f).collect();
        }
        let next = AtomicUsize::new(0);
        let results: Vec<parking_lot::Mutex<Option<Result<()>>>> =
            (0..n).map(|_| parking_lot::Mutex::new(None)).collect();
        std::thread::scope(|s| {
            for _ in 0..n {
                s.spawn(|| {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= n {
                            break;
                        }
                        *results[i].lock() = Some(f(i));
                    }
                });
            }
        });
        results
            .into_iter()
            .map(|r| {
                r.into_inner().unwrap_or_else(|| {
                    Err(GdsError::new(GdsErrorKind::Io, "an I/O thread ended early"))
                })
            })
            .collect()
    }
}

impl<'d, D: Device> Drop for Executor<'d, D> {
    fn drop(&mut self) {
        for a in self.staging.drain(..) {
            self.dev.free(a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::HostDevice;
    use crate::plan::{GpuLayout, LayerPages, Run, plan_chunk};

    #[test]
    fn store_then_load_round_trips_through_a_file() {
        let dir = std::env::temp_dir().join(format!("kvtier-gds-exec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("slab");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.set_len(4 * 8192).unwrap();
        let dev = HostDevice::new();
        let fid = dev.register_file(file).unwrap();
        // "GPU memory": 8 blocks of one 6000-byte page each; chunks of 1 block, row 8192.
        let kv = dev.alloc(8 * 6000).unwrap();
        let data: Vec<u8> = (0..8 * 6000).map(|i| (i * 7 % 251) as u8).collect();
        dev.upload(kv, &data).unwrap();
        let layout = GpuLayout::new(vec![LayerPages::contiguous(6000, kv, 6000)], 1).unwrap();
        let runs = [Run {
            local: 0,
            row: 0,
            size: 6000,
            count: 1,
            local_stride: 0,
            row_stride: 0,
        }];
        let exec = Executor::new(&dev, 8192, 2 * 8192).unwrap();
        assert_eq!(exec.rows_in_flight(), 2);
        let plans: Vec<Vec<DeviceCopy>> = [5u64, 1, 6]
            .iter()
            .map(|b| plan_chunk(&runs, &layout, &[*b]).unwrap())
            .collect();
        let stores: Vec<StoreChunk> = plans
            .iter()
            .enumerate()
            .map(|(i, p)| StoreChunk {
                copies: p,
                slot: SlotLocation {
                    file: fid,
                    offset: i as u64 * 8192,
                },
            })
            .collect();
        let crcs: Vec<u32> = exec
            .store(&stores)
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        // On disk: block b's page, then zero padding; the CRC is crc32fast's over the row.
        let disk = std::fs::read(&path).unwrap();
        for (i, b) in [5usize, 1, 6].iter().enumerate() {
            let row = &disk[i * 8192..(i + 1) * 8192];
            assert_eq!(&row[..6000], &data[b * 6000..(b + 1) * 6000]);
            assert!(row[6000..].iter().all(|&x| x == 0));
            assert_eq!(crcs[i], crc32fast::hash(row));
        }
        // Load rows 0 and 2 into blocks 0 and 3; a wrong CRC leaves its blocks untouched.
        dev.zero(kv, 8 * 6000).unwrap();
        let into = [
            plan_chunk(&runs, &layout, &[0]).unwrap(),
            plan_chunk(&runs, &layout, &[3]).unwrap(),
            plan_chunk(&runs, &layout, &[7]).unwrap(),
        ];
        let loads = [
            LoadChunk {
                copies: &into[0],
                slot: stores[0].slot,
                crc: crcs[0],
            },
            LoadChunk {
                copies: &into[1],
                slot: stores[2].slot,
                crc: crcs[2],
            },
            LoadChunk {
                copies: &into[2],
                slot: stores[1].slot,
                crc: crcs[1] ^ 1,
            },
        ];
        let got = exec.load(&loads);
        assert_eq!(got[0], Ok(crcs[0]));
        assert_eq!(got[1], Ok(crcs[2]));
        assert_eq!(got[2].as_ref().unwrap_err().kind, GdsErrorKind::Checksum);
        let back = dev.download(kv, 8 * 6000).unwrap();
        assert_eq!(&back[..6000], &data[5 * 6000..6 * 6000]);
        assert_eq!(&back[3 * 6000..4 * 6000], &data[6 * 6000..7 * 6000]);
        assert!(
            back[7 * 6000..].iter().all(|&x| x == 0),
            "a failed CRC must not touch its blocks"
        );
        // A short read (slot past the end of the file) is an error, not a success.
        let past = [LoadChunk {
            copies: &into[0],
            slot: SlotLocation {
                file: fid,
                offset: 4 * 8192,
            },
            crc: 0,
        }];
        assert_eq!(
            exec.load(&past)[0].as_ref().unwrap_err().kind,
            GdsErrorKind::ShortIo
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_copy_outside_device_memory_fails_that_chunk_only() {
        let dev = HostDevice::new();
        let exec = Executor::new(&dev, 4096, 4096).unwrap();
        let bad = [DeviceCopy {
            device: 0x10,
            row: 0,
            size: 64,
            count: 1,
            device_stride: 0,
            row_stride: 0,
        }];
        let r = exec.store(&[StoreChunk {
            copies: &bad,
            slot: SlotLocation {
                file: FileId(0),
                offset: 0,
            },
        }]);
        assert_eq!(r[0].as_ref().unwrap_err().kind, GdsErrorKind::Plan);
        assert!(Executor::new(&dev, 1000, 4096).is_err());
    }
}
