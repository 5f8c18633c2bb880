//! The names of a tier's metadata files and of the operations on them, as the test-only fault
//! hook (`IoEngine::meta_fault`, with `test-support`) sees them. A shipped build names the
//! operations too, but injects nothing.

/// A file that a tier writes beside its data files, outside the engine's transfers (the G3
/// index), named so that faults can be injected into its operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetaFile {
    /// The index journal (and its temporary and previous-generation names).
    Journal,
    /// The index checkpoint (and its temporary and previous-generation names).
    Checkpoint,
    /// The directory holding them (its fsync).
    Directory,
}

/// An operation on a [`MetaFile`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MetaOp {
    /// Creating (or truncating) a file.
    Create,
    /// Writing bytes.
    Write,
    /// `fsync` / `fdatasync`.
    Sync,
    /// Renaming (or linking) a file to another name.
    Rename,
}
