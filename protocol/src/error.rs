use thiserror::Error;

/// Everything that can be wrong with a region or a message handed to this crate.
/// Values from shared memory are never trusted, so each check has its own variant.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ProtocolError {
    #[error("region too small: need {need} bytes, have {have}")]
    RegionTooSmall { need: usize, have: usize },
    #[error("region is not aligned to {align} bytes")]
    Misaligned { align: usize },
    #[error("bad magic {found:#010x} (expected {expected:#010x}): not a UMBP {what}")]
    BadMagic { what: &'static str, found: u32, expected: u32 },
    #[error("protocol version mismatch: peer speaks {found}, this build speaks {expected}")]
    VersionMismatch { found: u32, expected: u32 },
    #[error("corrupted ring: head {head}, tail {tail}, capacity {capacity}")]
    CorruptRing { head: u32, tail: u32, capacity: u32 },
    #[error("invalid {what}: {value}")]
    InvalidField { what: &'static str, value: u64 },
    #[error("arena range {offset}+{len} outside the arena of {arena_len} bytes")]
    ArenaOutOfRange { offset: u64, len: u64, arena_len: u64 },
    #[error("message truncated: need {need} bytes, got {got}")]
    Truncated { need: usize, got: usize },
}
