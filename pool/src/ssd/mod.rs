//! The SSD tier (issue #16, docs/ssd.md): an append-only segment log per drive, written and
//! read through io_uring with O_DIRECT, every record framed by CRC32C, rebuilt on start.
//!
//! Not yet wired into the pool: nothing demotes to or promotes from this store, the index
//! does not list its objects, and no daemon flag opens it (docs/ssd.md, "Not yet wired").
//!
//! Files: `format` (record header, footer; no I/O), `segment` (directories, files,
//! O_DIRECT), `uring` (one ring per drive), `store` (put/get/remove, capacity, compaction),
//! `rebuild` (warm restart), `bench` (the measurements `umbp-bench ssd` reports).

pub mod bench;
pub mod format;
mod rebuild;
pub mod segment;
mod store;
pub mod uring;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

pub use store::{PutOutcome, SsdObjectInfo, SsdStats, SsdStore};

/// SSD tier settings. `Default` gives the documented defaults with no directory.
#[derive(Debug, Clone)]
pub struct SsdConfig {
    /// One directory per drive; each is one shard (keys are spread over them by hash).
    /// Their order must stay the same across restarts.
    pub dirs: Vec<PathBuf>,
    /// Bytes of segment files all directories together may hold (split evenly).
    pub capacity_bytes: u64,
    /// Above this fraction of a shard's capacity a put first reclaims space...
    pub high_watermark: f64,
    /// ...down to this fraction (compaction first, then dropping the oldest segments).
    pub low_watermark: f64,
    /// Largest segment file (records plus footer); an object's record must fit in one.
    pub segment_bytes: u64,
    /// A sealed segment whose live bytes are below this fraction is compacted first.
    pub compact_live_ratio: f64,
    /// io_uring entries and registered buffers per drive.
    pub queue_depth: u32,
    /// Use io_uring (false, or where the kernel refuses it: synchronous pread/pwrite).
    pub io_uring: bool,
    /// Open segment files with O_DIRECT where the file system takes it (false: always
    /// buffered, through the page cache).
    pub direct_io: bool,
    /// Bytes per registered buffer: the largest single I/O (a record is split into the
    /// fewest near-equal chunks).
    pub chunk_bytes: usize,
}

impl Default for SsdConfig {
    fn default() -> Self {
        Self {
            dirs: Vec::new(),
            capacity_bytes: 0,
            high_watermark: 0.95,
            low_watermark: 0.85,
            segment_bytes: 256 << 20,
            compact_live_ratio: 0.5,
            queue_depth: 64,
            chunk_bytes: 1 << 20,
            direct_io: true,
            io_uring: true,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SsdError {
    #[error("{}: {what}: {source}", path.display())]
    Io { path: PathBuf, what: String, source: std::io::Error },
    #[error("{}: SSD directory path is not a directory", .0.display())]
    NotADirectory(PathBuf),
    #[error("{}: SSD directory is in use by another pool (lock .umbp-ssd.lock held): {source}", path.display())]
    Locked { path: PathBuf, source: std::io::Error },
    #[error("{}: disk full writing segment (ENOSPC/EFBIG): {source}", path.display())]
    DiskFull { path: PathBuf, source: std::io::Error },
    #[error("SSD tier full: object of {needed} bytes does not fit in {capacity} bytes of capacity in {}", dir.display())]
    NoRoom { needed: u64, capacity: u64, dir: PathBuf },
    #[error("object of {size} bytes is larger than a segment ({segment_bytes} bytes); raise the segment size")]
    TooLarge { size: u64, segment_bytes: u64 },
    #[error("io_uring unavailable for SSD directory {}: {source}", path.display())]
    Uring { path: PathBuf, source: std::io::Error },
    #[error("SSD configuration: {0}")]
    Config(String),
}
