//! Counters of one GPU copy engine (one device of one backend).

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of one GPU's copy engine since the backend opened it, as
/// [`crate::Backend::engine_stats`] and the pool report show them (serde: the report's
/// JSON form, the UUID as 32 hex digits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EngineStats {
    /// Device ordinal in the pool process.
    pub ordinal: i32,
    /// Device UUID (HIP: the identity of `hip::device_identity`).
    #[serde(with = "uuid_hex")]
    pub device_uuid: [u8; 16],
    /// Copy calls (one per transfer group or pipelined transfer on this GPU).
    pub calls: u64,
    /// Copies handed to the driver (ops cut at 16 MiB and at registration ends).
    pub items: u64,
    pub bytes: u64,
    /// Time spent handing copies to the driver.
    pub enqueue_ns: u64,
    /// Time of whole copy calls (fence waits, enqueue, synchronization).
    pub total_ns: u64,
    /// Stages reported finished before their copy call ended (staged calls).
    pub stages: u64,
}

impl EngineStats {
    /// Adds the counters of `other` (another engine, or a later snapshot's difference):
    /// calls, items, bytes, times and stages; the device identity stays this one's.
    pub fn add(&mut self, other: &EngineStats) {
        self.calls += other.calls;
        self.items += other.items;
        self.bytes += other.bytes;
        self.enqueue_ns += other.enqueue_ns;
        self.total_ns += other.total_ns;
        self.stages += other.stages;
    }
}

/// The live counters behind [`EngineStats`].
#[derive(Default)]
pub(super) struct EngineCounters {
    calls: AtomicU64,
    items: AtomicU64,
    bytes: AtomicU64,
    enqueue_ns: AtomicU64,
    total_ns: AtomicU64,
    stages: AtomicU64,
}

/// What one copy call adds.
pub(super) struct CallCounts {
    pub items: u64,
    pub bytes: u64,
    pub enqueue_ns: u64,
    pub total_ns: u64,
    pub stages: u64,
}

impl EngineCounters {
    pub(super) fn add(&self, c: CallCounts) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.items.fetch_add(c.items, Ordering::Relaxed);
        self.bytes.fetch_add(c.bytes, Ordering::Relaxed);
        self.enqueue_ns.fetch_add(c.enqueue_ns, Ordering::Relaxed);
        self.total_ns.fetch_add(c.total_ns, Ordering::Relaxed);
        self.stages.fetch_add(c.stages, Ordering::Relaxed);
    }

    pub(super) fn snapshot(&self, ordinal: i32, device_uuid: [u8; 16]) -> EngineStats {
        EngineStats {
            ordinal,
            device_uuid,
            calls: self.calls.load(Ordering::Relaxed),
            items: self.items.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            enqueue_ns: self.enqueue_ns.load(Ordering::Relaxed),
            total_ns: self.total_ns.load(Ordering::Relaxed),
            stages: self.stages.load(Ordering::Relaxed),
        }
    }
}

/// A device UUID as 32 lowercase hex digits (the pool report's form).
mod uuid_hex {
    use serde::de::Error;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(u: &[u8; 16], s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&format_args!("{:032x}", u128::from_be_bytes(*u)))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<[u8; 16], D::Error> {
        let s = String::deserialize(d)?;
        if s.len() != 32 {
            return Err(D::Error::custom(format!("device_uuid {s:?}: not 32 hex digits")));
        }
        u128::from_str_radix(&s, 16).map(u128::to_be_bytes).map_err(|_| D::Error::custom(format!("device_uuid {s:?}: not 32 hex digits")))
    }
}
