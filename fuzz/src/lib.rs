//! The fuzz targets' bodies (each `fuzz_targets/<name>.rs` calls `<name>::run`). Every
//! target checks properties, not only "no crash": what the pool accepts stays inside the
//! ranges a peer registered, the index never reports a hit that is not in its table, a
//! corrupted ring never hands out more entries than it holds.

use umbp_protocol::layout::{CopyOp, KvLayout, MAX_OBJECT_BYTES};

/// Buffer aligned to 128 bytes (ring and index headers need it).
pub struct Aligned {
    buf: Vec<u128>,
    pub len: usize,
}

impl Aligned {
    pub fn zeroed(len: usize) -> Self {
        Self { buf: vec![0u128; len / 16 + 9], len }
    }

    pub fn ptr(&mut self) -> *mut u8 {
        let p = self.buf.as_mut_ptr() as usize;
        ((p + 127) & !127) as *mut u8
    }

    pub fn bytes(&mut self) -> &mut [u8] {
        let len = self.len;
        // SAFETY: the buffer holds len + 144 bytes; ptr() skips at most 127 of them.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), len) }
    }
}

/// A validated layout: every page of every block lies inside its allocation and the
/// object bytes add up; planning a block stays in range, one past the end is refused.
pub fn check_layout(l: &KvLayout, size: &dyn Fn(u32) -> Option<u64>) {
    assert!(l.num_blocks() >= 1);
    assert!(l.object_bytes() >= 1 && l.object_bytes() <= MAX_OBJECT_BYTES);
    let mut total = 0u128;
    for s in l.segments() {
        let alloc = size(s.alloc_id).expect("a validated segment names a known allocation") as u128;
        let end = s.offset as u128 + (s.num_blocks as u128 - 1) * s.block_stride as u128 + s.page_bytes as u128;
        assert!(end <= alloc, "segment {s:?} ends at {end}, past its allocation of {alloc}");
        assert!(s.num_blocks >= l.num_blocks());
        total += s.page_bytes as u128;
    }
    assert_eq!(total, l.object_bytes() as u128);
    for b in [0, l.num_blocks() / 2, l.num_blocks() - 1] {
        let mut ops = Vec::new();
        l.plan_block(b, 0, &mut ops).expect("in-range block plans");
        check_ops(&ops, size, l.object_bytes());
    }
    let mut ops = Vec::new();
    assert!(l.plan_block(l.num_blocks(), 0, &mut ops).is_err() && ops.is_empty());
}

/// Copies of one object stored at host offset 0: device side inside the allocation, host
/// side inside the object.
pub fn check_ops(ops: &[CopyOp], size: &dyn Fn(u32) -> Option<u64>, object_bytes: u64) {
    for op in ops {
        let alloc = size(op.alloc_id).expect("known allocation") as u128;
        assert!(op.device_offset as u128 + op.len as u128 <= alloc, "{op:?} past allocation {alloc}");
        assert!(op.host_offset as u128 + op.len as u128 <= object_bytes as u128, "{op:?} past object {object_bytes}");
    }
}

pub mod handshake {
    //! Handshake and control-message decoding: MessageHeader framing over a real socket
    //! pair (`umbp_ipc::message::recv_message`), Hello checks (`validate::check_hello`),
    //! RegisterMemory / RegisterLayout payloads and the layouts they produce.

    use std::io::Write;
    use std::os::unix::net::UnixStream;
    use std::time::Duration;

    use umbp_pool::validate;
    use umbp_pool::PoolConfig;
    use umbp_protocol::layout::KvLayout;
    use umbp_protocol::wire::{self, MessageHeader, MessageKind, Role, MAX_SEGMENTS};
    use umbp_protocol::{MAGIC, PROTOCOL_VERSION};

    const POOL_UID: u32 = 1000;

    fn config(ctl: u8) -> PoolConfig {
        let mut c = PoolConfig { capacity_bytes: 64 << 20, ..Default::default() };
        c.allow_uids = vec![7];
        if ctl & 2 != 0 {
            c.namespace_acl.insert(7, vec![1, 0xfeed]);
        }
        if ctl & 4 != 0 {
            c.limits.arena_bytes = 8 << 20;
            c.limits.sq_entries = 2048;
            c.limits.registered_bytes = 1 << 20;
        }
        c
    }

    fn alloc_size(id: u32) -> Option<u64> {
        match id {
            0 => Some(1 << 20),
            1 => Some(4096),
            2 => Some(u64::MAX),
            _ => None,
        }
    }

    fn dispatch(kind: MessageKind, payload: &[u8], uid: u32, cfg: &PoolConfig) {
        match kind {
            MessageKind::Hello => match validate::check_hello(payload, uid, POOL_UID, cfg) {
                Ok(a) => {
                    assert_eq!((a.hello.magic, a.hello.protocol_version), (MAGIC, PROTOCOL_VERSION));
                    assert_eq!(Role::from_u32(a.hello.role), Ok(a.role));
                    assert!(uid == 0 || uid == POOL_UID || cfg.allow_uids.contains(&uid));
                    if uid == 7 && !cfg.namespace_acl.is_empty() {
                        assert!(cfg.namespace_acl[&7].contains(&a.hello.namespace()), "ACL bypassed");
                    }
                    assert!(a.layout.sq_entries <= cfg.limits.sq_entries);
                    assert!(a.layout.arena_bytes as u64 <= cfg.limits.arena_bytes.next_multiple_of(4096));
                    assert!(a.layout.total_bytes >= a.layout.arena_offset + a.layout.arena_bytes);
                }
                Err(r) => assert!(!r.message.is_empty() && r.status != wire::ReplyStatus::Ok),
            },
            MessageKind::RegisterMemory => {
                if let Ok((reg, _kind)) = validate::parse_memory_registration(payload) {
                    let ok = validate::check_registration(3, 1000, reg.size, &cfg.limits).is_ok();
                    assert_eq!(ok, 1000u128 + reg.size as u128 <= cfg.limits.registered_bytes as u128);
                }
            }
            MessageKind::RegisterLayout => {
                if let Ok((group, segments)) = validate::parse_layout(payload) {
                    let header: wire::LayoutHeader = wire::decode(payload).expect("parsed");
                    assert_eq!(group as u32, header.group);
                    assert!(segments.len() as u32 == header.segment_count && header.segment_count <= MAX_SEGMENTS);
                    if let Ok(l) = KvLayout::new(segments, alloc_size) {
                        crate::check_layout(&l, &alloc_size);
                    }
                }
            }
            MessageKind::HelloReply => {
                if let Ok(r) = wire::decode::<wire::HelloReply>(payload) {
                    let _ = r.message();
                }
            }
            MessageKind::Reply => {
                if let Ok(r) = wire::decode::<wire::Reply>(payload) {
                    let _ = (r.message(), wire::ReplyStatus::from_u32(r.status));
                }
            }
            MessageKind::StatsRequest | MessageKind::ResetNamespace => {}
            #[allow(unreachable_patterns)]
            _ => {}
        }
    }

    /// `data[0]`: which uid the peer runs as and which pool limits apply; the rest is what
    /// the peer sends: one or more framed messages.
    pub fn run(data: &[u8]) {
        let Some((&ctl, rest)) = data.split_first() else { return };
        let cfg = config(ctl);
        let uid = match ctl >> 6 {
            0 => 0,
            1 => POOL_UID,
            2 => 7,
            _ => 4242,
        };
        // The same bytes decoded directly (header, then payload)...
        if rest.len() >= 16 {
            let header: MessageHeader = bytemuck::pod_read_unaligned(&rest[..16]);
            if let Ok(kind) = header.validate() {
                assert!(header.len <= wire::MAX_MESSAGE_PAYLOAD && header.fd_count <= 8);
                let end = rest.len().min(16 + header.len as usize);
                dispatch(kind, &rest[16..end], uid, &cfg);
            }
        }
        // ...and through the real framing code over a socket.
        if ctl & 1 == 0 {
            let (mut a, b) = UnixStream::pair().expect("socketpair");
            if a.write_all(rest).is_err() {
                return;
            }
            let _ = a.shutdown(std::net::Shutdown::Write);
            for _ in 0..8 {
                match umbp_ipc::message::recv_message(&b, Some(Duration::from_millis(50))) {
                    Ok(m) => {
                        assert!(m.payload.len() <= wire::MAX_MESSAGE_PAYLOAD as usize && m.fds.is_empty());
                        dispatch(m.kind, &m.payload, uid, &cfg);
                    }
                    Err(_) => break,
                }
            }
        }
    }
}

pub mod sqe {
    //! SQE + arena validation against a registered layout (`validate::check_sqe`), checked
    //! against an independent model of the rules, and the in-flight admission rule.

    use std::sync::Arc;

    use arbitrary::Arbitrary;
    use umbp_pool::validate::{self, SqeCheck};
    use umbp_pool::PeerLimits;
    use umbp_protocol::arena::Arena;
    use umbp_protocol::entries::{BlockRef, BlockStatus, BusyReason, CqeError, Sqe, MAX_BLOCKS_PER_SQE};
    use umbp_protocol::layout::{KvLayout, Segment};

    #[derive(Arbitrary, Debug)]
    pub struct RawSegment {
        alloc: u8,
        offset: u64,
        stride: u64,
        page: u64,
        blocks: u64,
        small: bool,
    }

    #[derive(Arbitrary, Debug)]
    pub struct Input {
        segments: Vec<RawSegment>,
        alloc_sizes: [u32; 3],
        huge_alloc: bool,
        sqe: [u8; 64],
        fixup: u8,
        arena_len: u16,
        refs: Vec<(u8, u64)>,
        arena_seed: Vec<u8>,
        inflight: u32,
        inflight_bytes: u64,
        cq_entries: u32,
        limit_inflight: u32,
        limit_bytes: u64,
    }

    fn range_ok(offset: u64, len: u128, align: u64, arena_len: u64) -> bool {
        offset as u128 + len <= arena_len as u128 && offset % align == 0
    }

    pub fn run(input: Input) {
        let sizes = input.alloc_sizes;
        let huge = input.huge_alloc;
        let alloc_size = move |id: u32| -> Option<u64> {
            match id {
                0 if huge => Some(u64::MAX),
                0..=2 => Some(sizes[id as usize] as u64),
                _ => None,
            }
        };
        let segments: Vec<Segment> = input
            .segments
            .iter()
            .take(8)
            .map(|s| {
                if s.small {
                    Segment::new(s.alloc as u32 % 4, s.offset & 0xffff, s.stride & 0xfff, s.page & 0xfff, s.blocks & 0x3f)
                } else {
                    Segment::new(s.alloc as u32, s.offset, s.stride, s.page, s.blocks)
                }
            })
            .collect();
        let layout = KvLayout::new(segments, alloc_size).ok().map(Arc::new);
        if let Some(l) = &layout {
            crate::check_layout(l, &alloc_size);
        }

        let arena_len = input.arena_len as u64;
        let mut mem = crate::Aligned::zeroed(arena_len as usize);
        let n = input.arena_seed.len().min(arena_len as usize);
        mem.bytes()[..n].copy_from_slice(&input.arena_seed[..n]);
        // SAFETY: the buffer outlives the arena and holds arena_len bytes.
        let arena = unsafe { Arena::new(mem.ptr(), arena_len as usize) };

        let mut sqe: Sqe = bytemuck::pod_read_unaligned(&input.sqe);
        let f = input.fixup;
        if f & 1 != 0 {
            sqe.opcode = 1 + (f >> 4 & 1);
        }
        if f & 2 != 0 {
            sqe.count = 1 + sqe.count % 16;
        }
        if f & 4 != 0 && arena_len > 0 {
            sqe.refs_offset = (sqe.refs_offset % arena_len) & !7;
            sqe.status_offset %= arena_len;
        }
        if f & 8 != 0 {
            sqe.group = 0;
        }
        if f & 16 != 0 {
            let nb = layout.as_ref().map_or(4, |l| l.num_blocks());
            let refs: Vec<BlockRef> =
                input.refs.iter().take(16).map(|&(k, b)| BlockRef { key: [k as u64, 0], block_id: b % (nb + 2) }).collect();
            let _ = arena.write(sqe.refs_offset, &refs);
        }

        // The rules, written independently of validate.rs.
        let expected: Result<bool, CqeError> = if !(1..=3).contains(&sqe.opcode) {
            Err(CqeError::BadOpcode)
        } else if sqe.opcode == 3 {
            Ok(false)
        } else if sqe.count == 0 || sqe.count > MAX_BLOCKS_PER_SQE {
            Err(CqeError::TooManyBlocks)
        } else if sqe.group != 0 || layout.is_none() {
            Err(CqeError::UnknownGroup)
        } else if !range_ok(sqe.refs_offset, sqe.count as u128 * 24, 8, arena_len)
            || !range_ok(sqe.status_offset, sqe.count as u128, 1, arena_len)
            // A cancellable transfer's state word: 8 aligned bytes inside the arena.
            || (sqe.flags & 1 != 0 && !range_ok(sqe.state_offset, 8, 8, arena_len))
        {
            Err(CqeError::ArenaOutOfRange)
        } else {
            Ok(true)
        };

        let got = validate::check_sqe(&sqe, &arena, |g| if g == 0 { layout.clone() } else { None });
        match (got, expected) {
            (Ok(SqeCheck::Nop), Ok(false)) => {}
            (Ok(SqeCheck::Transfer(sub)), Ok(true)) => {
                let l = layout.as_ref().expect("expected says registered");
                assert_eq!(sub.refs.len(), sqe.count as usize);
                assert_eq!(sub.in_range.len(), sub.refs.len());
                // The private copy is what the arena held.
                let at = sqe.refs_offset as usize;
                let raw = &mem.bytes()[at..at + 24 * sub.refs.len()];
                for (i, r) in sub.refs.iter().enumerate() {
                    let want: BlockRef = bytemuck::pod_read_unaligned(&raw[i * 24..(i + 1) * 24]);
                    assert_eq!(*r, want);
                    assert_eq!(sub.in_range[i], r.block_id < l.num_blocks());
                    if sub.in_range[i] {
                        let mut ops = Vec::new();
                        l.plan_block(r.block_id, 0, &mut ops).expect("in-range block plans");
                        crate::check_ops(&ops, &alloc_size, l.object_bytes());
                    }
                }
                assert_eq!(sub.bytes() as u128, sqe.count as u128 * l.object_bytes() as u128);
                let statuses = vec![BlockStatus::Invalid as u8; sub.refs.len()];
                arena.write(sqe.status_offset, &statuses).expect("status range was validated");
            }
            (Err(e), Err(want)) => assert_eq!(e, want, "{sqe:?}"),
            (got, want) => panic!("check_sqe gave {got:?}, the rules say {want:?} for {sqe:?}"),
        }

        let limits = PeerLimits {
            inflight: input.limit_inflight.max(1),
            inflight_bytes: input.limit_bytes.max(1),
            ..Default::default()
        };
        let bytes = input.inflight_bytes >> 8;
        match validate::admit(input.inflight, input.inflight_bytes, input.cq_entries, bytes, &limits) {
            Ok(()) => {
                assert!(input.inflight < input.cq_entries.min(limits.inflight));
                assert!(input.inflight == 0 || input.inflight_bytes as u128 + bytes as u128 <= limits.inflight_bytes as u128);
            }
            Err(BusyReason::InflightTransfers) => assert!(input.inflight >= input.cq_entries.min(limits.inflight)),
            Err(BusyReason::InflightBytes) => assert!(input.inflight > 0),
            Err(r) => panic!("admit gave {r:?}"),
        }
    }
}

pub mod index {
    //! The index reader over arbitrary memory: `IndexView::attach`, then lookups,
    //! `match_prefix`, `probe_histogram` and `snapshot` over a region whose header and slots
    //! are fuzzed. A hit must be a FULL slot of the active table with that key and location.

    use arbitrary::Arbitrary;
    use umbp_protocol::index::{region_bytes, IndexView, MIN_SLOTS};
    use umbp_protocol::ObjectKey;

    #[derive(Arbitrary, Debug)]
    pub struct SlotWrite {
        table: bool,
        idx: u16,
        seq: u32,
        state: u8,
        key_pick: u8,
        key: u128,
        location: u64,
    }

    #[derive(Arbitrary, Debug)]
    pub struct Input {
        format: bool,
        slots_2048: bool,
        header_patches: Vec<(u16, u64)>,
        epoch: u64,
        cut: u16,
        slots: Vec<SlotWrite>,
        lookups: Vec<u128>,
    }

    fn rd64(b: &[u8], at: usize) -> u64 {
        u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
    }

    fn rd32(b: &[u8], at: usize) -> u32 {
        u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
    }

    pub fn run(input: Input) {
        let buf_len = region_bytes(2 * MIN_SLOTS);
        let mut mem = crate::Aligned::zeroed(buf_len);
        let p = mem.ptr();
        let slot_count = if input.slots_2048 { 2 * MIN_SLOTS } else { MIN_SLOTS };
        if input.format {
            // SAFETY: the buffer outlives the view and holds buf_len bytes.
            unsafe { IndexView::init(p, buf_len, slot_count) }.expect("valid init");
        }
        {
            let b = mem.bytes();
            b[128..136].copy_from_slice(&input.epoch.to_le_bytes());
            for &(off, v) in input.header_patches.iter().take(8) {
                let off = (off as usize % 4088) & !7;
                b[off..off + 8].copy_from_slice(&v.to_le_bytes());
            }
        }
        let keys: Vec<u128> = input.lookups.iter().take(32).copied().collect();
        {
            let b = mem.bytes();
            let count = rd64(b, 8).clamp(1, 1 << 20);
            for w in input.slots.iter().take(256) {
                let table_off = rd64(b, 16 + 8 * w.table as usize) as usize;
                let at = table_off.saturating_add((w.idx as usize % count as usize) * 32);
                if table_off % 32 != 0 || at.saturating_add(32) > buf_len {
                    continue;
                }
                let key = if !keys.is_empty() && w.key_pick & 1 == 1 { keys[w.key_pick as usize / 2 % keys.len()] } else { w.key };
                b[at..at + 4].copy_from_slice(&w.seq.to_le_bytes());
                b[at + 4..at + 8].copy_from_slice(&((w.state % 4) as u32).to_le_bytes());
                b[at + 8..at + 24].copy_from_slice(&key.to_le_bytes());
                b[at + 24..at + 32].copy_from_slice(&w.location.to_le_bytes());
            }
        }
        let len = buf_len - (input.cut as usize % 8192).min(buf_len);
        // SAFETY: the buffer outlives the view and holds at least len bytes.
        let Ok(view) = (unsafe { IndexView::attach(p as *const u8, len) }) else { return };
        let n = view.slot_count() as usize;
        assert!(n.is_power_of_two() && umbp_protocol::index::region_bytes(n as u64) <= len);

        let b = mem.bytes().to_vec();
        let epoch = rd64(&b, 128);
        let table = rd64(&b, 16 + 8 * (epoch & 1) as usize) as usize;
        let is_hit = |k: u128, loc: u64| {
            (0..n).any(|i| {
                let at = table + i * 32;
                rd32(&b, at + 4) == 1 && u128::from_le_bytes(b[at + 8..at + 24].try_into().unwrap()) == k && rd64(&b, at + 24) == loc
            })
        };
        let mut found = Vec::new();
        for &k in &keys {
            let r = view.lookup(ObjectKey(k));
            if let Some(loc) = r {
                assert!(is_hit(k, loc), "lookup({k:#x}) = {loc} is not a FULL slot of the active table");
            }
            found.push(r.is_some());
        }
        let ks: Vec<ObjectKey> = keys.iter().map(|&k| ObjectKey(k)).collect();
        let m = view.match_prefix(&ks);
        assert_eq!(m, found.iter().take_while(|f| **f).count());
        let hist = view.probe_histogram(8);
        assert!(hist.len() == 8 && hist.iter().sum::<u64>() <= n as u64);
        let snap = view.snapshot();
        assert_eq!(snap.slot_count, n as u64);
    }
}

pub mod ring {
    //! Ring consumer and producer over a header a peer corrupted: any sequence of counter
    //! scribbles, pops, pushes and sleeps. `available()` never exceeds the capacity, the
    //! producer never has more than `capacity` entries outstanding against the head it
    //! read, and between two changes of the other side's counter each side moves at most
    //! two windows (the one it had cached and one validated after the change).

    use arbitrary::Arbitrary;
    use umbp_protocol::entries::Sqe;
    use umbp_protocol::ring::{ring_bytes, Ring, RingHeader};

    #[derive(Arbitrary, Debug)]
    pub enum Op {
        SetTail(u32),
        AddTail(u8),
        SetHead(u32),
        SetNeedWakeup(u32),
        Pop(u8),
        Available,
        PrepareSleep,
        FinishSleep,
        Push(u8),
        Publish,
        Snapshot,
        Reattach,
    }

    #[derive(Arbitrary, Debug)]
    pub struct Input {
        cap_log: u8,
        init: bool,
        info_patch: Option<(u8, u32)>,
        cut: u16,
        ops: Vec<Op>,
    }

    pub fn run(input: Input) {
        let cap = 1u32 << (input.cap_log % 7);
        let buf_len = ring_bytes::<Sqe>(cap);
        let mut mem = crate::Aligned::zeroed(buf_len);
        let p = mem.ptr();
        if input.init {
            // SAFETY: the buffer outlives the ring and holds buf_len bytes.
            unsafe { Ring::<Sqe>::init(p, buf_len, cap) }.expect("valid init");
        }
        if let Some((field, v)) = input.info_patch {
            let at = (field as usize % 4) * 4;
            mem.bytes()[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        let len = buf_len - (input.cut as usize % 1024).min(buf_len);
        // SAFETY: the buffer outlives every handle and holds len bytes.
        let attach = || unsafe { Ring::<Sqe>::attach(p, len) };
        let (Ok(r1), Ok(r2)) = (attach(), attach()) else { return };
        let capacity = r1.capacity();
        assert!(ring_bytes::<Sqe>(capacity) <= len);
        // SAFETY: aligned and inside the buffer (attach checked both).
        let header = unsafe { &*(p as *const RingHeader) };
        let mut cons = r1.consumer();
        let mut prod = r2.producer();
        let (mut popped, mut pushed) = (0u64, 0u64);
        let mut out = Vec::new();
        use std::sync::atomic::Ordering::*;
        for op in input.ops.iter().take(256) {
            match *op {
                Op::SetTail(t) => {
                    header.tail.store(t, Release);
                    popped = 0;
                }
                Op::AddTail(n) => {
                    header.tail.fetch_add(n as u32, Release);
                    popped = 0;
                }
                Op::SetHead(h) => {
                    header.head.store(h, Release);
                    pushed = 0;
                }
                Op::SetNeedWakeup(v) => header.need_wakeup.store(v, Release),
                Op::Pop(max) => {
                    out.clear();
                    if let Ok(n) = cons.pop_batch(&mut out, max as usize % 80) {
                        assert!(n <= max as usize % 80 && n == out.len());
                        popped += n as u64;
                        if n > 0 {
                            pushed = 0;
                        }
                    }
                }
                Op::Available => {
                    if let Ok(n) = cons.available() {
                        assert!(n <= capacity, "available {n} > capacity {capacity}");
                    }
                }
                Op::PrepareSleep => {
                    let _ = cons.prepare_sleep();
                    pushed = 0;
                }
                Op::FinishSleep => cons.finish_sleep(),
                Op::Push(n) => {
                    for i in 0..n % 80 {
                        match prod.try_push(Sqe { user_data: i as u64, ..Sqe::default() }) {
                            Ok(true) => pushed += 1,
                            _ => break,
                        }
                    }
                }
                Op::Publish => {
                    let _ = prod.publish();
                    popped = 0;
                }
                Op::Snapshot => {
                    let _ = cons.ring().snapshot().len();
                }
                Op::Reattach => {
                    let (Ok(a), Ok(b)) = (attach(), attach()) else { return };
                    cons = a.consumer();
                    prod = b.producer();
                    popped = 0;
                    pushed = 0;
                }
            }
            // One window from the counter cached before the change plus one validated window
            // after it: never more.
            assert!(popped <= 2 * capacity as u64, "consumer took {popped} entries from a ring of {capacity}");
            assert!(pushed <= 2 * capacity as u64, "producer wrote {pushed} entries into a ring of {capacity}");
            assert!(prod.in_flight() <= capacity, "producer has {} entries outstanding", prod.in_flight());
        }
    }
}

pub mod control {
    //! The control plane's per-peer state machine (`umbp_pool::control::PeerConn`), fed
    //! arbitrary byte/fd sequences, EOFs, clock jumps, replies and partial writes, the way
    //! the pool's event loop drives it. Checked against an independent framing model:
    //! every message it hands out is exactly the next frame of the byte stream, with the
    //! fds that came with it; it never asks for bytes past the current frame, never holds
    //! more than one message or 8 fds, only hands out a Hello before the handshake is
    //! answered, and a deadline failure only happens at or after the deadline it reported.

    use std::os::fd::OwnedFd;
    use std::time::{Duration, Instant};

    use umbp_pool::control::{Event, Next, PeerConn, Phase, Timeouts, MAX_FDS, READ_CHUNK};
    use umbp_protocol::wire::{MessageHeader, MessageKind, MAX_MESSAGE_PAYLOAD};
    use umbp_protocol::MAGIC;

    const TIMEOUTS: Timeouts = Timeouts { handshake: Duration::from_millis(2000), message: Duration::from_millis(1000) };

    fn fds(n: usize, proto: &OwnedFd) -> Vec<OwnedFd> {
        (0..n).filter_map(|_| proto.try_clone().ok()).collect()
    }

    /// A byte source that mostly produces well-formed frames (so the fuzzer gets past the
    /// header check) and sometimes garbage.
    struct Source<'a> {
        data: &'a [u8],
    }

    impl Source<'_> {
        fn byte(&mut self) -> Option<u8> {
            let (&b, rest) = self.data.split_first()?;
            self.data = rest;
            Some(b)
        }

        fn take(&mut self, n: usize) -> &[u8] {
            let n = n.min(self.data.len());
            let (a, b) = self.data.split_at(n);
            self.data = b;
            a
        }
    }

    /// The stream the fuzzer sends: frames built from the input, interleaved with garbage.
    fn stream(src: &mut Source<'_>) -> Vec<u8> {
        let mut out = Vec::new();
        let kinds = [
            MessageKind::Hello,
            MessageKind::HelloReply,
            MessageKind::RegisterMemory,
            MessageKind::RegisterLayout,
            MessageKind::Reply,
            MessageKind::StatsRequest,
            MessageKind::ResetNamespace,
        ];
        for _ in 0..4 {
            let Some(ctl) = src.byte() else { break };
            if ctl & 0x80 != 0 {
                let n = (ctl & 0x1f) as usize;
                out.extend_from_slice(src.take(n));
                continue;
            }
            let kind = kinds[(ctl as usize & 0x7) % kinds.len()];
            let len = src.byte().unwrap_or(0) as usize * if ctl & 0x40 != 0 { 97 } else { 1 };
            let fd_count = ((ctl >> 3) & 0x3) as usize;
            let mut h = MessageHeader::new(kind, len, fd_count);
            if ctl & 0x20 != 0 && ctl & 0x40 != 0 {
                h.magic = MAGIC ^ 1;
            }
            out.extend_from_slice(bytemuck::bytes_of(&h));
            let payload = src.take(len).to_vec();
            out.extend_from_slice(&payload);
            out.resize(out.len() + len - payload.len(), 0);
        }
        out
    }

    pub fn run(data: &[u8]) {
        let proto: OwnedFd = match std::fs::File::open("/dev/null") {
            Ok(f) => f.into(),
            Err(_) => return,
        };
        let mut src = Source { data };
        let bytes = stream(&mut src);
        let t0 = Instant::now();
        let mut now = t0;
        let mut conn = PeerConn::new(now, TIMEOUTS);
        // Model: bytes consumed since the last message; fds fed with them.
        let mut pos = 0usize;
        let mut frame_start = 0usize;
        let mut frame_fds = 0usize;
        let mut frame_truncated = false;
        let mut awaiting = false;
        let mut answered_hello = false;
        while let Some(op) = src.byte() {
            let want = conn.want();
            assert!(want <= READ_CHUNK);
            match op % 6 {
                // Feed up to `want` bytes with 0..3 fds, maybe truncated.
                0 | 1 => {
                    if want == 0 {
                        continue;
                    }
                    let n = (src.byte().unwrap_or(1) as usize % want.min(64) + 1).min(bytes.len() - pos);
                    if n == 0 {
                        // The stream ran dry: EOF.
                        assert!(conn.feed(now, &[], Vec::new(), false).is_err(), "EOF ends the connection");
                        return;
                    }
                    let nfds = ((op >> 3) & 0x3) as usize;
                    let truncated = op & 0x40 != 0 && op & 0x80 != 0;
                    let chunk = &bytes[pos..pos + n];
                    pos += n;
                    frame_fds += nfds;
                    frame_truncated |= truncated;
                    let got = conn.feed(now, chunk, fds(nfds, &proto), truncated);
                    let event = match got {
                        Err(_) => return,
                        Ok(None) => {
                            assert!(pos - frame_start < 16 + MAX_MESSAGE_PAYLOAD as usize);
                            assert!(frame_fds <= MAX_FDS, "{frame_fds} fds held");
                            continue;
                        }
                        Ok(Some(e)) => e,
                    };
                    // The model: the frame is bytes[frame_start..pos].
                    let frame = &bytes[frame_start..pos];
                    let header: MessageHeader = bytemuck::pod_read_unaligned(&frame[..16]);
                    let kind = header.validate().expect("a message with a bad header was handed out");
                    assert_eq!(frame.len(), 16 + header.len as usize, "message is exactly one frame");
                    match event {
                        Event::Hello(p) => {
                            assert!(!answered_hello && kind == MessageKind::Hello);
                            assert_eq!(p, &frame[16..]);
                            assert!(!frame_truncated);
                            assert_eq!(frame_fds, header.fd_count as usize);
                        }
                        Event::Request(r) => {
                            assert!(answered_hello, "a request before the Hello was answered");
                            assert_eq!((r.kind, &r.payload[..]), (kind, &frame[16..]));
                            assert_eq!(r.fds.len(), header.fd_count as usize);
                            assert_eq!(frame_fds, r.fds.len());
                            assert!(!frame_truncated);
                        }
                        Event::Truncated(k) => {
                            assert!(frame_truncated && k == kind);
                        }
                    }
                    frame_start = pos;
                    frame_fds = 0;
                    frame_truncated = false;
                    awaiting = true;
                    assert_eq!(conn.want(), 0, "nothing is read while a message awaits its answer");
                }
                // Time passes.
                2 => {
                    let before = conn.deadline();
                    now += Duration::from_millis(src.byte().unwrap_or(0) as u64 * 16);
                    if conn.check(now).is_err() {
                        let d = before.expect("a deadline failure without a deadline");
                        assert!(now >= d, "failed before its deadline");
                        return;
                    }
                    if let Some(d) = before {
                        assert!(now < d || awaiting, "passed its deadline without failing");
                    }
                }
                // The driver answers.
                3 => {
                    if !awaiting {
                        continue;
                    }
                    let next = match (conn.phase(), src.byte().unwrap_or(0) % 4) {
                        (_, 0) => Next::Close,
                        (Phase::Handshake, _) => Next::Attach,
                        _ => Next::Continue,
                    };
                    let len = src.byte().unwrap_or(0) as usize;
                    let nfds = (op >> 3) as usize % 5;
                    conn.respond(now, MessageKind::Reply, &vec![0u8; len], fds(nfds, &proto), next);
                    awaiting = false;
                    if next == Next::Attach {
                        answered_hello = true;
                        assert_eq!(conn.phase(), Phase::Attached);
                    }
                    let (out, out_fds) = conn.output();
                    assert!(out.len() >= 16 + len && out_fds.len() >= nfds);
                }
                // Part of the output is written.
                4 => {
                    let (out, _) = conn.output();
                    let n = (src.byte().unwrap_or(0) as usize).min(out.len());
                    conn.wrote(n);
                    if conn.is_done() {
                        return;
                    }
                }
                // EOF.
                _ => {
                    if want > 0 {
                        assert!(conn.feed(now, &[], Vec::new(), false).is_err());
                        return;
                    }
                }
            }
        }
    }
}
