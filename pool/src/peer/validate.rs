//! Pure checks of everything a peer sends: the Hello, control-message payloads and
//! submissions, and the per-peer limits. No threads, no I/O and no pool state beyond what
//! is passed in, so the fuzz targets (`fuzz/`) run exactly the code the pool runs.
//!
//! Submissions follow docs/protocol.md §4: the SQE is already a private copy; the block
//! list is copied out of the arena once (bounds and alignment checked with overflow-checked
//! arithmetic) and only the copy is validated and used.

use std::sync::Arc;

use umbp_protocol::arena::Arena;
use umbp_protocol::attachment::AttachmentLayout;
use umbp_protocol::entries::{BlockRef, BusyReason, CqeError, Opcode, Sqe, MAX_BLOCKS_PER_SQE, SQE_CANCELLABLE};
use umbp_protocol::layout::{KvLayout, Segment};
use umbp_protocol::ring::MAX_RING_CAPACITY;
use umbp_protocol::wire::{self, Hello, LayoutHeader, MemoryKind, MemoryRegistration, ReplyStatus, Role};
use umbp_protocol::ProtocolError;

use crate::config::{PeerLimits, PoolConfig};

/// Hint ring entries every attachment gets.
pub const HINT_ENTRIES: u32 = 1024;

/// Why a Hello or a control message is refused: the reply status and a readable message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: ReplyStatus,
    pub message: String,
}

impl Refusal {
    fn new(status: ReplyStatus, message: String) -> Self {
        Self { status, message }
    }
}

/// A Hello the pool accepts, with the ring layout it will create.
#[derive(Debug, Clone, Copy)]
pub struct AcceptedHello {
    pub hello: Hello,
    pub role: Role,
    pub layout: AttachmentLayout,
}

/// Decodes and checks a Hello payload from a peer running as `uid` (from SO_PEERCRED):
/// magic, version, role, uid allow-list, namespace ACL, ring and arena sizes against the
/// limits. `pool_uid` and root are always allowed and never namespace-restricted.
pub fn check_hello(payload: &[u8], uid: u32, pool_uid: u32, cfg: &PoolConfig) -> Result<AcceptedHello, Refusal> {
    let hello: Hello = wire::decode(payload).map_err(|e| Refusal::new(ReplyStatus::InvalidRequest, format!("bad Hello: {e}")))?;
    let role = match hello.validate() {
        Ok(r) => r,
        Err(e @ ProtocolError::VersionMismatch { .. }) => {
            return Err(Refusal::new(ReplyStatus::VersionMismatch, format!("umbp-pool refuses: {e}")))
        }
        Err(e @ ProtocolError::BadMagic { .. }) => return Err(Refusal::new(ReplyStatus::BadMagic, format!("umbp-pool refuses: {e}"))),
        Err(e) => return Err(Refusal::new(ReplyStatus::InvalidRequest, format!("umbp-pool refuses: {e}"))),
    };
    let privileged = uid == pool_uid || uid == 0;
    if !(privileged || cfg.allow_uids.contains(&uid)) {
        return Err(Refusal::new(
            ReplyStatus::PermissionDenied,
            format!("uid {uid} is not allowed by this pool (start it with --allow-uid {uid})"),
        ));
    }
    let namespace = hello.namespace();
    if !privileged && !cfg.namespace_acl.is_empty() {
        let allowed = cfg.namespace_acl.get(&uid).is_some_and(|list| list.contains(&namespace));
        if !allowed {
            return Err(Refusal::new(
                ReplyStatus::PermissionDenied,
                format!("namespace {namespace:032x} is not allowed for uid {uid} (--namespace-acl)"),
            ));
        }
    }
    let limits = &cfg.limits;
    let sq = if hello.sq_entries == 0 { cfg.default_sq_entries } else { hello.sq_entries };
    let arena = if hello.arena_bytes == 0 { cfg.default_arena_bytes } else { hello.arena_bytes };
    if sq > limits.sq_entries {
        return Err(Refusal::new(
            ReplyStatus::ResourceExhausted,
            format!("sq_entries {sq} exceeds this pool's limit of {} (--max-sq-entries)", limits.sq_entries),
        ));
    }
    if arena > limits.arena_bytes {
        return Err(Refusal::new(
            ReplyStatus::ResourceExhausted,
            format!("arena_bytes {arena} exceeds this pool's limit of {} (--max-arena-bytes)", limits.arena_bytes),
        ));
    }
    let layout = AttachmentLayout::new(sq, sq.saturating_mul(2).min(MAX_RING_CAPACITY), HINT_ENTRIES, arena)
        .map_err(|e| Refusal::new(ReplyStatus::InvalidRequest, format!("bad ring sizes: {e}")))?;
    Ok(AcceptedHello { hello, role, layout })
}

/// Attachment counts: `total` live attachments, `of_uid` of them by `uid`.
pub fn check_attachment_count(total: usize, of_uid: usize, uid: u32, cfg: &PoolConfig) -> Result<(), Refusal> {
    if total >= cfg.max_attachments {
        return Err(Refusal::new(ReplyStatus::ResourceExhausted, format!("pool has {total} attachments, the limit (--max-attachments)")));
    }
    if of_uid >= cfg.limits.attachments_per_uid {
        return Err(Refusal::new(
            ReplyStatus::ResourceExhausted,
            format!("uid {uid} already holds {of_uid} attachments, the limit per uid (--max-attachments-per-uid)"),
        ));
    }
    Ok(())
}

/// Decodes a RegisterMemory payload.
pub fn parse_memory_registration(payload: &[u8]) -> Result<(MemoryRegistration, MemoryKind), Refusal> {
    let bad = |e: ProtocolError| Refusal::new(ReplyStatus::InvalidRequest, format!("RegisterMemory: {e}"));
    let reg: MemoryRegistration = wire::decode(payload).map_err(bad)?;
    let kind = MemoryKind::from_u32(reg.kind).map_err(bad)?;
    Ok((reg, kind))
}

/// An attachment with `regions` regions of `bytes` in all wants to add one of `size`.
pub fn check_registration(regions: usize, bytes: u64, size: u64, limits: &PeerLimits) -> Result<(), Refusal> {
    if regions >= limits.regions {
        return Err(Refusal::new(
            ReplyStatus::ResourceExhausted,
            format!("attachment already has {regions} regions, the limit (--max-regions)"),
        ));
    }
    let total = bytes.checked_add(size).filter(|&t| t <= limits.registered_bytes);
    if total.is_none() {
        return Err(Refusal::new(
            ReplyStatus::ResourceExhausted,
            format!(
                "registering {size} more bytes would exceed the {} bytes one attachment may register \
                 (--max-registered-bytes; {bytes} registered)",
                limits.registered_bytes
            ),
        ));
    }
    Ok(())
}

/// Decodes a RegisterLayout payload: the group and its segments (not yet checked against
/// the registered regions: [`KvLayout::new`] does that).
pub fn parse_layout(payload: &[u8]) -> Result<(u16, Vec<Segment>), Refusal> {
    let bad = |m: String| Refusal::new(ReplyStatus::InvalidRequest, m);
    let header: LayoutHeader = wire::decode(payload).map_err(|e| bad(format!("RegisterLayout: {e}")))?;
    if header.group > u16::MAX as u32 || header.segment_count > wire::MAX_SEGMENTS {
        return Err(bad("RegisterLayout: group or segment count out of range".into()));
    }
    let seg_bytes = &payload[std::mem::size_of::<LayoutHeader>()..];
    let need = header.segment_count as usize * std::mem::size_of::<Segment>();
    if seg_bytes.len() < need {
        return Err(bad(format!("RegisterLayout: truncated: need {need} segment bytes")));
    }
    let segments = seg_bytes[..need].chunks_exact(std::mem::size_of::<Segment>()).map(bytemuck::pod_read_unaligned).collect();
    Ok((header.group as u16, segments))
}

/// An attachment with `layouts` layouts registers `group` (`replaces`: it had one).
pub fn check_layout_count(layouts: usize, replaces: bool, limits: &PeerLimits) -> Result<(), Refusal> {
    if !replaces && layouts >= limits.layouts {
        return Err(Refusal::new(
            ReplyStatus::ResourceExhausted,
            format!("attachment already has {layouts} layouts, the limit (--max-layouts)"),
        ));
    }
    Ok(())
}

/// A layout's objects must be at least `--min-object-size` (`min_object_bytes`): the
/// shared index is sized for `capacity / min_object_bytes` objects, so smaller ones would
/// fill it long before DRAM (16 KiB objects in a pool sized for 64 KiB: at 37.5 % of DRAM)
/// and one tenant could fill it for everyone with tiny objects.
pub fn check_layout_object(group: u16, object_bytes: u64, min_object_bytes: u64) -> Result<(), Refusal> {
    if object_bytes < min_object_bytes {
        return Err(Refusal::new(
            ReplyStatus::InvalidRequest,
            format!(
                "RegisterLayout group {group}: objects of {object_bytes} bytes < this pool's --min-object-size \
                 {min_object_bytes} (its index is sized for that); restart it with --min-object-size {object_bytes} or less"
            ),
        ));
    }
    Ok(())
}

/// What a valid store or load asks for, all of it private copies.
#[derive(Debug, Clone)]
pub struct Submission {
    pub op: Opcode,
    pub layout: Arc<KvLayout>,
    pub refs: Vec<BlockRef>,
    /// Per block: its id is inside the layout (the others complete as `Invalid`).
    pub in_range: Vec<bool>,
    /// Arena offset of the transfer's state word when the worker may cancel it
    /// (`SQE_CANCELLABLE`; checked in range and aligned).
    pub state_offset: Option<u64>,
}

impl Submission {
    /// Bytes the submission may move (blocks x object bytes), for the in-flight limit.
    pub fn bytes(&self) -> u64 {
        self.refs.len() as u64 * self.layout.object_bytes()
    }
}

/// Outcome of [`check_sqe`].
#[derive(Debug, Clone)]
pub enum SqeCheck {
    /// Completes at once.
    Nop,
    Transfer(Submission),
}

/// Validates one submission (a private copy of the SQE) against the attachment's arena and
/// layouts: opcode, block count, group, the block list's and the status array's arena
/// ranges; copies the block list out of the arena once. `layout_of(group)` returns the
/// group's registered layout.
pub fn check_sqe(sqe: &Sqe, arena: &Arena, layout_of: impl FnOnce(u16) -> Option<Arc<KvLayout>>) -> Result<SqeCheck, CqeError> {
    let op = Opcode::from_u8(sqe.opcode).map_err(|_| CqeError::BadOpcode)?;
    if op == Opcode::Nop {
        return Ok(SqeCheck::Nop);
    }
    if sqe.count == 0 || sqe.count > MAX_BLOCKS_PER_SQE {
        return Err(CqeError::TooManyBlocks);
    }
    let layout = layout_of(sqe.group).ok_or(CqeError::UnknownGroup)?;
    let refs: Vec<BlockRef> = arena.read(sqe.refs_offset, sqe.count as u64).map_err(|_| CqeError::ArenaOutOfRange)?;
    arena.check_range::<u8>(sqe.status_offset, sqe.count as u64).map_err(|_| CqeError::ArenaOutOfRange)?;
    let state_offset = if sqe.flags & SQE_CANCELLABLE != 0 {
        arena.check_range::<u64>(sqe.state_offset, 1).map_err(|_| CqeError::ArenaOutOfRange)?;
        Some(sqe.state_offset)
    } else {
        None
    };
    let in_range = refs.iter().map(|r| r.block_id < layout.num_blocks()).collect();
    Ok(SqeCheck::Transfer(Submission { op, layout, refs, in_range, state_offset }))
}

/// Admission of a submission of `bytes` for an attachment with `inflight` submissions
/// moving `inflight_bytes` in flight and a completion ring of `cq_entries`.
pub fn admit(inflight: u32, inflight_bytes: u64, cq_entries: u32, bytes: u64, limits: &PeerLimits) -> Result<(), BusyReason> {
    if inflight >= cq_entries.min(limits.inflight) {
        return Err(BusyReason::InflightTransfers);
    }
    // Something must be in flight for the byte limit to refuse: a submission larger than
    // the limit on its own still goes through, alone.
    // Overflow is over any limit (found by fuzz/sqe: a saturating sum let it through).
    if inflight > 0 && inflight_bytes.checked_add(bytes).is_none_or(|sum| sum > limits.inflight_bytes) {
        return Err(BusyReason::InflightBytes);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use umbp_protocol::ObjectKey;

    fn cfg() -> PoolConfig {
        PoolConfig { capacity_bytes: 64 << 20, ..Default::default() }
    }

    #[test]
    fn hello_refusals_name_the_reason() {
        let c = cfg();
        let ok = Hello::new(Role::Worker, 5, 1);
        let a = check_hello(bytemuck::bytes_of(&ok), 1000, 1000, &c).unwrap();
        assert_eq!((a.role, a.layout.sq_entries, a.layout.cq_entries), (Role::Worker, 1024, 2048));
        assert_eq!(check_hello(&[1, 2], 0, 0, &c).unwrap_err().status, ReplyStatus::InvalidRequest);
        let e = check_hello(bytemuck::bytes_of(&ok), 7, 1000, &c).unwrap_err();
        assert_eq!(e.status, ReplyStatus::PermissionDenied);
        assert!(e.message.contains("--allow-uid 7"), "{}", e.message);
        let mut big = ok;
        big.arena_bytes = 128 << 20;
        let e = check_hello(bytemuck::bytes_of(&big), 0, 0, &c).unwrap_err();
        assert!(e.status == ReplyStatus::ResourceExhausted && e.message.contains("--max-arena-bytes"), "{e:?}");
        big = ok;
        big.sq_entries = 1 << 15;
        let e = check_hello(bytemuck::bytes_of(&big), 0, 0, &c).unwrap_err();
        assert!(e.message.contains("--max-sq-entries"), "{e:?}");
        let mut role = ok;
        role.role = 9;
        assert!(check_hello(bytemuck::bytes_of(&role), 0, 0, &c).unwrap_err().message.contains("role"));
    }

    #[test]
    fn namespace_acl_default_denies_listed_pools() {
        let mut c = cfg();
        c.allow_uids = vec![7, 8];
        c.namespace_acl.insert(7, vec![5]);
        let h = |ns| Hello::new(Role::Scheduler, ns, 1);
        assert!(check_hello(bytemuck::bytes_of(&h(5)), 7, 1000, &c).is_ok());
        let e = check_hello(bytemuck::bytes_of(&h(6)), 7, 1000, &c).unwrap_err();
        assert!(e.status == ReplyStatus::PermissionDenied && e.message.contains("--namespace-acl"), "{e:?}");
        // uid 8 has no entry: denied once any ACL exists.
        assert!(check_hello(bytemuck::bytes_of(&h(5)), 8, 1000, &c).is_err());
        // The pool's own uid and root are not restricted.
        assert!(check_hello(bytemuck::bytes_of(&h(6)), 1000, 1000, &c).is_ok());
        assert!(check_hello(bytemuck::bytes_of(&h(6)), 0, 1000, &c).is_ok());
    }

    #[test]
    fn layouts_below_the_min_object_size_are_refused() {
        assert!(check_layout_object(0, 65536, 65536).is_ok());
        let e = check_layout_object(3, 16384, 65536).unwrap_err();
        assert_eq!(e.status, ReplyStatus::InvalidRequest);
        for part in ["group 3", "16384", "65536", "--min-object-size 16384"] {
            assert!(e.message.contains(part), "{part}: {}", e.message);
        }
        // It fits a Reply message (191 bytes) whole with realistic sizes.
        let e = check_layout_object(u16::MAX, 1536, 1 << 40);
        assert!(e.unwrap_err().message.len() < umbp_protocol::wire::REPLY_MESSAGE_LEN);
    }

    #[test]
    fn limits() {
        let mut c = cfg();
        c.limits.attachments_per_uid = 2;
        assert!(check_attachment_count(5, 1, 9, &c).is_ok());
        assert!(check_attachment_count(5, 2, 9, &c).unwrap_err().message.contains("--max-attachments-per-uid"));
        assert!(check_attachment_count(1024, 0, 9, &c).unwrap_err().message.contains("--max-attachments"));
        let l = PeerLimits { registered_bytes: 100, regions: 2, layouts: 1, ..Default::default() };
        assert!(check_registration(1, 50, 50, &l).is_ok());
        assert!(check_registration(1, 50, 51, &l).unwrap_err().message.contains("--max-registered-bytes"));
        assert!(check_registration(1, 50, u64::MAX, &l).is_err(), "overflow is a refusal");
        assert!(check_registration(2, 0, 1, &l).unwrap_err().message.contains("--max-regions"));
        assert!(check_layout_count(1, true, &l).is_ok());
        assert!(check_layout_count(1, false, &l).unwrap_err().message.contains("--max-layouts"));
        let l = PeerLimits { inflight: 4, inflight_bytes: 100, ..Default::default() };
        assert_eq!(admit(0, 0, 2048, 1 << 40, &l), Ok(()), "alone, a large submission goes through");
        assert_eq!(admit(1, 60, 2048, 50, &l), Err(BusyReason::InflightBytes));
        assert_eq!(admit(4, 0, 2048, 1, &l), Err(BusyReason::InflightTransfers));
        assert_eq!(admit(2, 0, 2, 1, &l), Err(BusyReason::InflightTransfers), "completion ring caps it too");
        // Regression (fuzz/sqe crash): a sum that overflows u64 must not pass an unlimited
        // (u64::MAX) byte limit.
        let unlimited = PeerLimits { inflight: u32::MAX, inflight_bytes: u64::MAX, ..Default::default() };
        assert_eq!(admit(1, u64::MAX - 252, u32::MAX, u64::MAX >> 8, &unlimited), Err(BusyReason::InflightBytes));
    }

    #[test]
    fn sqe_checks() {
        let mut buf = vec![0u64; 512];
        // SAFETY: buf outlives the arena.
        let arena = unsafe { Arena::new(buf.as_mut_ptr() as *mut u8, 4096) };
        let layout = Arc::new(KvLayout::new(vec![Segment::new(0, 0, 64, 64, 4)], |_| Some(1 << 20)).unwrap());
        arena.write(0, &[BlockRef::new(ObjectKey(1), 3), BlockRef::new(ObjectKey(2), 4)]).unwrap();
        let s = Sqe { opcode: Opcode::Store as u8, count: 2, status_offset: 2048, ..Sqe::default() };
        let SqeCheck::Transfer(sub) = check_sqe(&s, &arena, |_| Some(layout.clone())).unwrap() else { panic!() };
        assert_eq!(sub.in_range, vec![true, false]);
        assert_eq!(sub.bytes(), 128);
        assert!(matches!(check_sqe(&Sqe { opcode: 3, ..s }, &arena, |_| None), Ok(SqeCheck::Nop)));
        assert_eq!(check_sqe(&Sqe { opcode: 0, ..s }, &arena, |_| None).unwrap_err(), CqeError::BadOpcode);
        assert_eq!(check_sqe(&s, &arena, |_| None).unwrap_err(), CqeError::UnknownGroup);
        assert_eq!(check_sqe(&Sqe { count: 0, ..s }, &arena, |_| None).unwrap_err(), CqeError::TooManyBlocks);
        let far = Sqe { status_offset: 4095, ..s };
        assert_eq!(check_sqe(&far, &arena, |_| Some(layout.clone())).unwrap_err(), CqeError::ArenaOutOfRange);
        let odd = Sqe { refs_offset: 4, ..s };
        assert_eq!(check_sqe(&odd, &arena, |_| Some(layout.clone())).unwrap_err(), CqeError::ArenaOutOfRange);
    }

    #[test]
    fn layout_payloads() {
        let mut msg = bytemuck::bytes_of(&LayoutHeader { group: 3, segment_count: 1 }).to_vec();
        msg.extend_from_slice(bytemuck::bytes_of(&Segment::new(0, 0, 64, 64, 4)));
        assert_eq!(parse_layout(&msg).unwrap(), (3, vec![Segment::new(0, 0, 64, 64, 4)]));
        assert!(parse_layout(&msg[..20]).unwrap_err().message.contains("truncated"));
        assert!(parse_layout(&msg[..4]).is_err());
        let over = bytemuck::bytes_of(&LayoutHeader { group: 1 << 16, segment_count: 1 }).to_vec();
        assert!(parse_layout(&over).unwrap_err().message.contains("out of range"));
        assert!(parse_memory_registration(&[0; 8]).unwrap_err().message.starts_with("RegisterMemory"));
    }
}
