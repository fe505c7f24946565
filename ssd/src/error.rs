//! The errors of the SSD tier: a setting that cannot be used, and a store that cannot work.

use std::path::PathBuf;

/// A setting of this tier that cannot be used, naming its key (the pool turns it into its
/// `ConfigError::Invalid`, so operators see one error form for every setting).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct InvalidSetting {
    pub key: String,
    pub message: String,
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
    /// Segments without a salt file that appeared while the directory was opened (the
    /// opener removes those it finds first): refused, never read as format 2.
    #[error("{}: SSD directory holds {segments} segment file(s) and no .umbp-ssd.salt: they are of SSD format 1 (or their salt file was removed); this pool reads and writes format 2 only (salted record headers, docs/ssd.md); remove the seg-*.umbp files there (their objects are lost: the SSD tier is a cache and refills) or give an empty directory", path.display())]
    OldFormat { path: PathBuf, segments: usize },
    /// The directory (or one above it) is another user's or writable by others.
    #[error(transparent)]
    UnsafeDir(#[from] umbp_ipc::sockdir::UnsafeDir),
    /// A file in an SSD directory the pool must not use (a symlink, another uid's file, a
    /// hard link, not a regular file).
    #[error("{}: {message}", path.display())]
    Unsafe { path: PathBuf, message: String },
}
