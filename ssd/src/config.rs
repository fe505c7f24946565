//! The tier's settings, their defaults and the checks that make them usable.

use std::path::PathBuf;

use super::admission::SsdAdmission;
use super::error::InvalidSetting;

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
    /// While running, the pool flushes the tier (`SsdStore::flush`: footers, fdatasync of
    /// the segments written since their last sync, directory fsyncs) this often when
    /// something was written since the last flush, so that what it stored survives a power
    /// loss after at most about this long (docs/ssd.md). Zero: off (only a clean stop syncs).
    pub sync_interval: std::time::Duration,
}

/// Default bound of the flush on a clean stop: inside Kubernetes' default 30 s grace
/// period, with room for the rest of the stop.
pub const DEFAULT_FLUSH_ON_STOP: std::time::Duration = std::time::Duration::from_secs(20);

impl SsdConfig {
    /// The checks that make these settings usable, each error naming the setting's key.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        let inv = |key: &str, message: String| Err(InvalidSetting { key: key.into(), message });
        if self.dirs.is_empty() {
            return inv("ssd-dir", "no SSD directory given".into());
        }
        if self.low_watermark.partial_cmp(&self.high_watermark) == Some(std::cmp::Ordering::Greater)
            || !(self.low_watermark > 0.0 && self.high_watermark <= 1.0)
        {
            return inv(
                "ssd-low-watermark",
                format!("SSD watermarks must satisfy 0 < low ({}) <= high ({}) <= 1", self.low_watermark, self.high_watermark),
            );
        }
        let per_dir = self.capacity_bytes / self.dirs.len() as u64;
        if per_dir < self.segment_bytes {
            return inv(
                "ssd-capacity",
                format!(
                    "{} bytes over {} directories is less than one segment ({} bytes, --ssd-segment-size) per directory",
                    self.capacity_bytes,
                    self.dirs.len(),
                    self.segment_bytes
                ),
            );
        }
        if self.queue_depth == 0 {
            return inv("ssd-queue-depth", "must be at least 1".into());
        }
        Ok(())
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
            sync_interval: std::time::Duration::ZERO,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SsdConfig;

    #[test]
    fn validate_names_the_setting_it_refuses() {
        let ok = SsdConfig { dirs: vec!["/x".into()], capacity_bytes: 1 << 30, ..SsdConfig::default() };
        assert_eq!(ok.validate(), Ok(()));
        let key = |c: SsdConfig| c.validate().unwrap_err().key;
        assert_eq!(key(SsdConfig { dirs: vec![], ..ok.clone() }), "ssd-dir");
        assert_eq!(key(SsdConfig { low_watermark: 0.96, ..ok.clone() }), "ssd-low-watermark");
        assert_eq!(key(SsdConfig { high_watermark: 1.5, ..ok.clone() }), "ssd-low-watermark");
        assert_eq!(key(SsdConfig { dirs: vec!["/x".into(), "/y".into()], capacity_bytes: 256 << 20, ..ok.clone() }), "ssd-capacity");
        assert_eq!(key(SsdConfig { queue_depth: 0, ..ok }), "ssd-queue-depth");
    }
}
