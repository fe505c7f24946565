//! Ring entries and the arena records they point to.

use bytemuck::{Pod, Zeroable};

use crate::{assert_layout, ProtocolError};

/// What a submission asks the pool to do.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opcode {
    /// Copy blocks from worker memory into the pool (first writer wins).
    Store = 1,
    /// Copy blocks from the pool into worker memory.
    Load = 2,
    /// Completes at once; a liveness probe and a ring round-trip benchmark.
    Nop = 3,
}

impl Opcode {
    pub fn from_u8(v: u8) -> Result<Self, ProtocolError> {
        match v {
            1 => Ok(Self::Store),
            2 => Ok(Self::Load),
            3 => Ok(Self::Nop),
            _ => Err(ProtocolError::InvalidField { what: "opcode", value: v as u64 }),
        }
    }
}

/// `Sqe::flags` bit: `state_offset` names the transfer's state word; the worker may
/// abandon the transfer ([`crate::transfer_state`]).
pub const SQE_CANCELLABLE: u8 = 1;

/// Submission queue entry, worker -> pool. Variable-size data lives in the arena.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, Pod, Zeroable, PartialEq, Eq)]
pub struct Sqe {
    pub opcode: u8,
    pub flags: u8,
    /// KV cache group (layout) the block ids refer to.
    pub group: u16,
    /// Number of [`BlockRef`]s at `refs_offset`.
    pub count: u32,
    /// Echoed in the completion.
    pub user_data: u64,
    /// Arena offset of `[BlockRef; count]`.
    pub refs_offset: u64,
    /// Arena offset of `[u8; count]` where the pool writes each block's [`BlockStatus`].
    pub status_offset: u64,
    /// GPU path: wait until the fence word reaches this value before reading (0 = none).
    pub fence_value: u64,
    /// With `fence_value`: which registered allocation and slot hold the fence word
    /// (`umbp_gpu::fence::encode_ref`).
    pub fence_ref: u64,
    /// With [`SQE_CANCELLABLE`] in `flags`: arena offset of the transfer's state word
    /// (8-byte aligned), the cancel contract between worker and pool
    /// ([`crate::transfer_state`]). Without the flag the transfer cannot be cancelled.
    pub state_offset: u64,
    pub reserved: u64,
}
assert_layout!(Sqe, size = 64, align = 8);

/// Completion queue entry, pool -> worker.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, Pod, Zeroable, PartialEq, Eq)]
pub struct Cqe {
    pub user_data: u64,
    /// 0, or a negative [`CqeError`] when the whole submission was rejected.
    pub result: i32,
    /// Blocks that reached the wanted state (stored, already present or loaded).
    pub ok_count: u32,
    /// Blocks with any other status.
    pub failed_count: u32,
    pub _pad: u32,
    /// With `result == -Busy`: the [`BusyReason`] (which limit refused the submission);
    /// 0 otherwise. Peers that predate it ignore the word.
    pub reserved: u64,
}
assert_layout!(Cqe, size = 32, align = 8);

impl Cqe {
    /// Why a `Busy` completion was refused, if the pool said.
    pub fn busy_reason(&self) -> Option<BusyReason> {
        (self.result == -(CqeError::Busy as i32)).then(|| BusyReason::from_u64(self.reserved))
    }
}

/// Which limit a `Busy` completion hit (carried in [`Cqe::reserved`]).
#[repr(u64)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BusyReason {
    /// Not said (older pools).
    Unspecified = 0,
    /// The attachment has as many submissions in flight as its completion ring holds
    /// or `--max-inflight` allows.
    InflightTransfers = 1,
    /// The attachment's in-flight submissions already move `--max-inflight-bytes`.
    InflightBytes = 2,
}

impl BusyReason {
    pub fn from_u64(v: u64) -> Self {
        match v {
            1 => Self::InflightTransfers,
            2 => Self::InflightBytes,
            _ => Self::Unspecified,
        }
    }

    /// The pool option that sets the limit, for messages.
    pub fn limit_name(self) -> &'static str {
        match self {
            Self::Unspecified => "unspecified",
            Self::InflightTransfers => "--max-inflight",
            Self::InflightBytes => "--max-inflight-bytes",
        }
    }
}

/// Why a whole submission was rejected (negated in [`Cqe::result`]).
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CqeError {
    BadOpcode = 1,
    ArenaOutOfRange = 2,
    TooManyBlocks = 3,
    UnknownGroup = 4,
    /// Stalled, draining or out of transfer slots: try again later.
    Busy = 5,
    Internal = 6,
    /// The worker abandoned the transfer before the pool started it (its blocks were never
    /// touched); the pool's completion for it only frees the arena record.
    Cancelled = 7,
}

impl CqeError {
    pub fn from_result(result: i32) -> Option<Self> {
        Some(match -result {
            1 => Self::BadOpcode,
            2 => Self::ArenaOutOfRange,
            3 => Self::TooManyBlocks,
            4 => Self::UnknownGroup,
            5 => Self::Busy,
            6 => Self::Internal,
            7 => Self::Cancelled,
            _ => return None,
        })
    }
}

/// One block of a submission: which object, which block of the worker's layout.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable, PartialEq, Eq, Hash)]
pub struct BlockRef {
    pub key: [u64; 2],
    pub block_id: u64,
}
assert_layout!(BlockRef, size = 24, align = 8);

impl BlockRef {
    pub fn new(key: crate::ObjectKey, block_id: u64) -> Self {
        Self { key: key.to_words(), block_id }
    }
}

/// Per-block outcome, one byte each in the arena.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockStatus {
    Pending = 0,
    Stored = 1,
    /// Store skipped: the key exists (first writer wins); no copy made.
    AlreadyPresent = 2,
    /// Store refused: no room (never blocks, never evicts synchronously).
    NotStored = 3,
    Loaded = 4,
    /// Load of a key the pool does not hold (evicted, never stored).
    Missing = 5,
    /// The copy failed (peer memory gone, size mismatch, pool shutting down).
    Failed = 6,
    /// Block id out of the layout's range, or other bad input.
    Invalid = 7,
}

impl BlockStatus {
    pub fn from_u8(v: u8) -> Self {
        match v {
            0 => Self::Pending,
            1 => Self::Stored,
            2 => Self::AlreadyPresent,
            3 => Self::NotStored,
            4 => Self::Loaded,
            5 => Self::Missing,
            6 => Self::Failed,
            _ => Self::Invalid,
        }
    }

    /// Whether the block reached what its submission wanted.
    pub fn is_ok(self) -> bool {
        matches!(self, Self::Stored | Self::AlreadyPresent | Self::Loaded)
    }
}

/// Most blocks one submission may carry.
pub const MAX_BLOCKS_PER_SQE: u32 = 1 << 16;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_and_opcode_round_trip() {
        for v in 0..=7u8 {
            assert_eq!(BlockStatus::from_u8(v) as u8, v);
        }
        assert_eq!(BlockStatus::from_u8(200), BlockStatus::Invalid);
        assert!(Opcode::from_u8(0).is_err());
        assert_eq!(Opcode::from_u8(2), Ok(Opcode::Load));
        assert_eq!(CqeError::from_result(-(CqeError::Busy as i32)), Some(CqeError::Busy));
        assert_eq!(CqeError::from_result(0), None);
        let busy = Cqe { result: -(CqeError::Busy as i32), reserved: 2, ..Cqe::default() };
        assert_eq!(busy.busy_reason(), Some(BusyReason::InflightBytes));
        assert_eq!(Cqe { reserved: 2, ..Cqe::default() }.busy_reason(), None);
        assert_eq!(BusyReason::from_u64(99), BusyReason::Unspecified);
    }
}
