//! What the evictor and the store path hold the store to: [`Policy`].

/// What the evictor and the store path hold the store to (docs/security.md): byte and
/// index watermarks, per-namespace quotas, per-uid lease caps. `Default` is "no limits"
/// (unit tests); the pool builds it from its config with [`Policy::from_config`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    /// The evictor runs above `high` allocated bytes, down to `low`.
    pub high_bytes: u64,
    pub low_bytes: u64,
    /// ... and, for each group's index, above this fraction of its capacity in used slots
    /// (live entries and tombstones), down to `index_low_wm` of it in live entries.
    pub index_high_wm: f64,
    pub index_low_wm: f64,
    /// Most objects / bytes (slab footprint) one namespace may hold, written or being
    /// written; its own least recently used objects are evicted above `namespace_high`.
    pub namespace_max_objects: u64,
    pub namespace_max_bytes: u64,
    pub namespace_high: f64,
    pub namespace_low: f64,
    /// Bytes of objects one uid's touch hints may keep leased at once.
    pub lease_max_bytes: u64,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            high_bytes: u64::MAX,
            low_bytes: u64::MAX,
            index_high_wm: f64::INFINITY,
            index_low_wm: f64::INFINITY,
            namespace_max_objects: u64::MAX,
            namespace_max_bytes: u64::MAX,
            namespace_high: 1.0,
            namespace_low: 1.0,
            lease_max_bytes: u64::MAX,
        }
    }
}

impl Policy {
    /// `capacity` bytes of DRAM; `index_capacity`: the live entries an index sized for the
    /// whole pool takes (namespace quotas are shares of it, whatever group they are in).
    pub fn from_config(c: &crate::config::PoolConfig, capacity: u64, index_capacity: u64) -> Self {
        let frac = |n: u64, f: f64| (n as f64 * f) as u64;
        let share = c.namespace_share;
        Self {
            high_bytes: frac(capacity, c.high_watermark),
            low_bytes: frac(capacity, c.low_watermark),
            index_high_wm: c.high_watermark,
            index_low_wm: c.low_watermark,
            // Share 1: no quota (a full pool is the byte and index watermarks' business).
            namespace_max_objects: if share >= 1.0 { u64::MAX } else { frac(index_capacity, share).max(1) },
            namespace_max_bytes: if share >= 1.0 { u64::MAX } else { frac(capacity, share).max(1) },
            namespace_high: c.high_watermark,
            namespace_low: c.low_watermark,
            lease_max_bytes: frac(capacity, c.lease_share),
        }
    }
}
