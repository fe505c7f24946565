//! The SSD tier (issue #16, docs/ssd.md): an append-only segment log per drive, written and
//! read through io_uring with O_DIRECT, every record framed by CRC32C, rebuilt on start.
//!
//! The pool (`umbp-pool`) uses it through its `tier` module (demotion by the evictor,
//! promotion by loads, warm restart), configured by `PoolConfig::ssd`. The store needs nothing
//! of the pool: it is a crate of its own so the pool's tier seam is the only way in.
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

#[cfg(test)]
mod admission_tests {
    use super::SsdAdmission;
    use std::time::Duration;

    #[test]
    fn admission_policies_parse_and_decide() {
        let p = |v| SsdAdmission::parse("ssd-admission", v);
        assert_eq!(p("all"), Ok(SsdAdmission::All));
        assert_eq!(p(" Hit "), Ok(SsdAdmission::Hit));
        assert_eq!(p("never"), Ok(SsdAdmission::Never));
        assert_eq!(p("hit-or-young"), Ok(SsdAdmission::default()));
        let y = p("hit-or-young:2.5").unwrap();
        assert_eq!(y, SsdAdmission::HitOrYoung { young: Duration::from_millis(2500) });
        assert_eq!(y.to_string(), "hit-or-young:2.5");
        for bad in ["sometimes", "hit-or-young:", "hit-or-young:-1", "hit-or-young:x"] {
            assert!(p(bad).unwrap_err().to_string().starts_with("ssd-admission"), "{bad}");
        }
        let s = Duration::from_secs;
        assert!(SsdAdmission::All.admits(s(1000), 0));
        assert!(!SsdAdmission::Never.admits(s(0), 5));
        assert!(SsdAdmission::Hit.admits(s(1000), 1) && !SsdAdmission::Hit.admits(s(0), 0));
        assert!(y.admits(s(1), 0) && !y.admits(s(3), 0) && y.admits(s(3), 1), "young or hit");
    }
}

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
    /// Which objects evicted from DRAM are written to this tier (the pool's demotion).
    pub admission: SsdAdmission,
    /// On a clean stop (SIGTERM/SIGINT, `Pool::shutdown`, dropping the pool) the pool
    /// writes its DRAM objects that `admission` admits and that have no SSD record yet to
    /// this tier for at most this long, so a restart on the same directories finds them
    /// (docs/ssd.md, "Clean stop"). Zero: off.
    pub flush_on_stop: std::time::Duration,
}

/// Default bound of the flush on a clean stop: inside Kubernetes' default 30 s grace
/// period, with room for the rest of the stop.
pub const DEFAULT_FLUSH_ON_STOP: std::time::Duration = std::time::Duration::from_secs(20);

/// Which DRAM objects the evictor demotes to SSD instead of dropping (docs/ssd.md,
/// "Admission"). Every write wears the drive; the default keeps objects that proved useful
/// (loaded at least once) or that are young (evicted soon after being stored: DRAM churns
/// faster than the prefix is reused), and drops old never-loaded ones.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SsdAdmission {
    /// Every evicted object.
    All,
    /// Objects loaded at least once while in DRAM.
    Hit,
    /// Objects loaded at least once, or stored less than `young` before their eviction.
    HitOrYoung { young: std::time::Duration },
    /// None: the tier only serves what it already holds (e.g. a read-only warm start).
    Never,
}

/// Default age under which an evicted object counts as young (`hit-or-young`).
pub const DEFAULT_YOUNG: std::time::Duration = std::time::Duration::from_secs(60);

impl Default for SsdAdmission {
    fn default() -> Self {
        SsdAdmission::HitOrYoung { young: DEFAULT_YOUNG }
    }
}

impl SsdAdmission {
    /// `all`, `hit`, `never`, `hit-or-young` (60 s) or `hit-or-young:SECONDS`.
    pub fn parse(key: &str, value: &str) -> Result<Self, InvalidSetting> {
        let bad = || InvalidSetting {
            key: key.into(),
            message: format!("{value:?}: expected all, hit, never, hit-or-young or hit-or-young:SECONDS"),
        };
        let v = value.trim().to_ascii_lowercase();
        Ok(match v.as_str() {
            "all" => SsdAdmission::All,
            "hit" => SsdAdmission::Hit,
            "never" | "none" => SsdAdmission::Never,
            "hit-or-young" => SsdAdmission::default(),
            _ => {
                let secs = v.strip_prefix("hit-or-young:").ok_or_else(bad)?;
                let secs: f64 = secs.trim().parse().map_err(|_| bad())?;
                if !(secs.is_finite() && secs >= 0.0) {
                    return Err(bad());
                }
                SsdAdmission::HitOrYoung { young: std::time::Duration::from_secs_f64(secs) }
            }
        })
    }

    /// Whether an object evicted `age` after it was stored, loaded `hits` times, goes to SSD.
    pub fn admits(&self, age: std::time::Duration, hits: u32) -> bool {
        match *self {
            SsdAdmission::All => true,
            SsdAdmission::Hit => hits > 0,
            SsdAdmission::HitOrYoung { young } => hits > 0 || age < young,
            SsdAdmission::Never => false,
        }
    }
}

impl std::fmt::Display for SsdAdmission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SsdAdmission::All => f.write_str("all"),
            SsdAdmission::Hit => f.write_str("hit"),
            SsdAdmission::Never => f.write_str("never"),
            SsdAdmission::HitOrYoung { young } => write!(f, "hit-or-young:{}", young.as_secs_f64()),
        }
    }
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
            admission: SsdAdmission::default(),
            flush_on_stop: DEFAULT_FLUSH_ON_STOP,
        }
    }
}

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
    /// The directory (or one above it) is another user's or writable by others.
    #[error(transparent)]
    UnsafeDir(#[from] umbp_ipc::sockdir::UnsafeDir),
    /// A file in an SSD directory the pool must not use (a symlink, another uid's file, a
    /// hard link, not a regular file).
    #[error("{}: {message}", path.display())]
    Unsafe { path: PathBuf, message: String },
}
