//! The SSD tier's settings: what a face leaves unset takes the table's default or its one
//! rule (capacity from the free space, segment size from the capacity), and the checks of
//! an `SsdConfig` that `PoolConfig::validate` runs, the directories on disk included.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::settings;
use super::{table_default, ConfigError};
use umbp_ssd::{SsdAdmission, SsdConfig};

/// Largest default segment: what eviction drops at once, and what one object may span.
pub const MAX_DEFAULT_SEGMENT_BYTES: u64 = 256 << 20;

/// The SSD tier as a face gives it; None: the table's default (or its rule).
#[derive(Debug, Clone, Default)]
pub struct SsdSettings {
    /// One directory per drive; empty: no SSD tier.
    pub dirs: Vec<PathBuf>,
    pub capacity_bytes: Option<u64>,
    pub high_watermark: Option<f64>,
    pub low_watermark: Option<f64>,
    pub direct_io: Option<bool>,
    pub admission: Option<SsdAdmission>,
    pub segment_bytes: Option<u64>,
    pub queue_depth: Option<u32>,
    pub flush_on_stop: Option<Duration>,
    pub sync_interval: Option<Duration>,
}

impl SsdSettings {
    /// The tier's config, None without a directory. Capacity unset: half of the free space
    /// of the first directory's file system, at least one segment per directory; segment
    /// size unset: 256 MiB, or a quarter of the capacity per directory (whole MiB, at least
    /// 1 MiB) where that is less. Checks run in `PoolConfig::validate`.
    pub fn resolve(self) -> Result<Option<SsdConfig>, ConfigError> {
        use settings::*;
        let dirs: Vec<PathBuf> = self.dirs.into_iter().filter(|d| !d.as_os_str().is_empty()).collect();
        if dirs.is_empty() {
            return Ok(None);
        }
        let n = dirs.len() as u64;
        let capacity_bytes = match self.capacity_bytes {
            Some(c) => c,
            None => {
                let floor = self.segment_bytes.unwrap_or(MAX_DEFAULT_SEGMENT_BYTES) * n;
                let free = free_bytes(&dirs[0])
                    .map_err(|e| ConfigError::setting(&SSD_DIR, format!("{}: statvfs: {e} (give a capacity)", dirs[0].display())))?;
                (free / 2).max(floor)
            }
        };
        let segment_bytes = self.segment_bytes.unwrap_or_else(|| default_segment_bytes(capacity_bytes, n));
        Ok(Some(SsdConfig {
            dirs,
            capacity_bytes,
            high_watermark: self.high_watermark.unwrap_or_else(|| table_default(&SSD_HIGH_WM, super::parse_fraction)),
            low_watermark: self.low_watermark.unwrap_or_else(|| table_default(&SSD_LOW_WM, super::parse_fraction)),
            direct_io: self.direct_io.unwrap_or_else(|| table_default(&SSD_DIRECT_IO, super::parse_bool)),
            admission: match self.admission {
                Some(a) => a,
                None => table_default(&SSD_ADMISSION, parse_admission),
            },
            segment_bytes,
            queue_depth: self.queue_depth.unwrap_or_else(|| table_default(&SSD_QUEUE_DEPTH, super::parse_number)),
            flush_on_stop: self.flush_on_stop.unwrap_or_else(|| table_default(&SSD_FLUSH_ON_STOP, super::parse_seconds)),
            sync_interval: self.sync_interval.unwrap_or_else(|| table_default(&SSD_SYNC_INTERVAL, super::parse_seconds)),
            ..SsdConfig::default()
        }))
    }
}

/// `--ssd-admission`: all, hit, never, hit-or-young or hit-or-young:SECONDS.
pub fn parse_admission(key: &str, value: &str) -> Result<SsdAdmission, ConfigError> {
    Ok(SsdAdmission::parse(key, value)?)
}

/// 256 MiB, or a quarter of `capacity / dirs` in whole MiB (at least 1 MiB) where less: at
/// least four segments per directory where the capacity allows.
pub fn default_segment_bytes(capacity: u64, dirs: u64) -> u64 {
    MAX_DEFAULT_SEGMENT_BYTES.min((capacity / dirs.max(1) / 4) & !((1 << 20) - 1)).max(1 << 20)
}

/// The checks of an SSD tier's config: the tier's own rules, and each directory exists, is a
/// directory and is writable by this process.
pub(super) fn validate(ssd: &SsdConfig) -> Result<(), ConfigError> {
    // The tier's own rules (watermarks, sizes, queue depth) live with the tier; the errors
    // name its flags, which `ConfigError::from` maps to the table's rows.
    ssd.validate()?;
    if ssd.flush_on_stop > Duration::from_secs(86_400) {
        return Err(ConfigError::setting(&settings::SSD_FLUSH_ON_STOP, format!("{:?} is more than a day", ssd.flush_on_stop)));
    }
    if ssd.sync_interval > Duration::from_secs(86_400) {
        return Err(ConfigError::setting(&settings::SSD_SYNC_INTERVAL, format!("{:?} is more than a day", ssd.sync_interval)));
    }
    ssd.dirs.iter().try_for_each(|d| check_dir(d))
}

/// A directory of the SSD tier must exist, be a directory and be writable by this process,
/// so that a typo stops the pool at start, naming the setting and the path.
fn check_dir(d: &Path) -> Result<(), ConfigError> {
    let bad = |message: String| Err(ConfigError::setting(&settings::SSD_DIR, message));
    let meta = match std::fs::metadata(d) {
        Ok(m) => m,
        Err(e) => return bad(format!("{}: {e} (create the directory first)", d.display())),
    };
    if !meta.is_dir() {
        return bad(format!("{}: not a directory", d.display()));
    }
    let Ok(c) = std::ffi::CString::new(d.as_os_str().as_encoded_bytes()) else {
        return bad(format!("{}: path contains a NUL byte", d.display()));
    };
    // SAFETY: a valid NUL-terminated path; access reads nothing else.
    if unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
        return bad(format!("{}: not writable by the pool: {}", d.display(), std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Free bytes (for unprivileged users) of the file system holding `d`.
fn free_bytes(d: &Path) -> std::io::Result<u64> {
    let c = std::ffi::CString::new(d.as_os_str().as_encoded_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: all-zero is a valid statvfs (plain integers).
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid NUL-terminated path and a valid out pointer.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}
