//! Pool configuration: the values, their defaults, and the parsers for the seed-compatible
//! spellings (`64GiB` sizes, `0.9` watermarks).

use std::path::PathBuf;
use std::time::Duration;

/// Everything a pool needs to start. `Default` gives the documented defaults.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Unix socket the pool listens on.
    pub socket_path: PathBuf,
    /// Bytes of DRAM the pool holds objects in.
    pub capacity_bytes: u64,
    /// The evictor starts above this fraction of capacity...
    pub high_watermark: f64,
    /// ...and stops below this one.
    pub low_watermark: f64,
    /// Back DRAM with 2 MiB huge pages (needs free pages in /proc/sys/vm/nr_hugepages).
    pub hugepages: bool,
    /// Bind DRAM to this NUMA node with mbind.
    pub numa_node: Option<u32>,
    /// Touch every page at start so first stores do not pay page faults.
    pub prefault: bool,
    /// Peer uids allowed besides the pool's own (root is always allowed).
    pub allow_uids: Vec<u32>,
    /// Smallest object the index is sized for (fixes the index capacity).
    pub min_object_bytes: u64,
    /// How long a touch hint protects an object from eviction.
    pub lease: Duration,
    /// Threads that run copies.
    pub copy_threads: usize,
    /// Limits per attachment.
    pub max_attachments: usize,
    pub default_sq_entries: u32,
    pub default_arena_bytes: u64,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            socket_path: umbp_ipc::default_socket_path(),
            capacity_bytes: default_capacity(),
            high_watermark: 0.9,
            low_watermark: 0.7,
            hugepages: false,
            numa_node: None,
            prefault: false,
            allow_uids: Vec::new(),
            min_object_bytes: 64 << 10,
            lease: Duration::from_millis(2000),
            copy_threads: std::thread::available_parallelism().map(|n| n.get().clamp(2, 8)).unwrap_or(2),
            max_attachments: 1024,
            default_sq_entries: 1024,
            default_arena_bytes: 4 << 20,
        }
    }
}

/// Errors that name the offending key and value.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("{key}: cannot parse {value:?} as a size (examples: 64GiB, 512MiB, 1073741824)")]
    BadSize { key: String, value: String },
    #[error("{key}: {value:?} is not a fraction between 0 and 1")]
    BadFraction { key: String, value: String },
    #[error("{key}: {message}")]
    Invalid { key: String, message: String },
}

/// Parses `64GiB`, `64G`, `1.5 GiB`, `512MB`, `4096` (bytes). Binary units for both
/// spellings (`G` = `GiB`), as operators mean when sizing DRAM.
pub fn parse_size(key: &str, value: &str) -> Result<u64, ConfigError> {
    let bad = || ConfigError::BadSize { key: key.to_string(), value: value.to_string() };
    let s = value.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let num: f64 = num.parse().map_err(|_| bad())?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(bad()),
    };
    let bytes = num * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 || (unit.trim().is_empty() && num.fract() != 0.0) {
        return Err(bad());
    }
    Ok(bytes as u64)
}

pub fn parse_fraction(key: &str, value: &str) -> Result<f64, ConfigError> {
    match value.trim().parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(ConfigError::BadFraction { key: key.to_string(), value: value.to_string() }),
    }
}

/// Half of the memory available now, at least 64 MiB: a safe share on a serving node
/// where the engines need the rest.
pub fn default_capacity() -> u64 {
    let avail = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024)
        .unwrap_or(1 << 30);
    (avail / 2).max(64 << 20) & !((2 << 20) - 1)
}

impl PoolConfig {
    /// Checks relations between values; messages name the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let inv = |key: &str, message: String| Err(ConfigError::Invalid { key: key.into(), message });
        if self.capacity_bytes < crate::alloc::PAGE_BYTES {
            return inv("capacity", format!("{} bytes is less than one 2 MiB page", self.capacity_bytes));
        }
        if !(self.low_watermark < self.high_watermark) {
            return inv(
                "low-wm",
                format!("low watermark {} must be below high watermark {}", self.low_watermark, self.high_watermark),
            );
        }
        if self.min_object_bytes == 0 {
            return inv("min-object-size", "must be positive".into());
        }
        if self.copy_threads == 0 {
            return inv("copy-threads", "must be at least 1".into());
        }
        if self.socket_path.as_os_str().len() >= 108 {
            return inv("socket", format!("{} is longer than a unix socket path may be (107 bytes)", self.socket_path.display()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("k", "64GiB"), Ok(64 << 30));
        assert_eq!(parse_size("k", "64G"), Ok(64 << 30));
        assert_eq!(parse_size("k", "1.5 GiB"), Ok(3 << 29));
        assert_eq!(parse_size("k", "4096"), Ok(4096));
        assert_eq!(parse_size("k", "512mb"), Ok(512 << 20));
        let e = parse_size("capacity_bytes", "lots").unwrap_err();
        assert!(e.to_string().starts_with("capacity_bytes:"), "{e}");
        assert!(parse_size("k", "12XB").is_err());
        assert!(parse_size("k", "1.5").is_err());
        assert!(parse_size("k", "").is_err());
    }

    #[test]
    fn fractions_and_relations() {
        assert_eq!(parse_fraction("high", "0.9"), Ok(0.9));
        assert!(parse_fraction("high", "1.5").unwrap_err().to_string().contains("high"));
        let mut c = PoolConfig { capacity_bytes: 64 << 20, ..Default::default() };
        c.validate().unwrap();
        c.low_watermark = 0.95;
        assert!(c.validate().unwrap_err().to_string().contains("low-wm"));
    }
}
