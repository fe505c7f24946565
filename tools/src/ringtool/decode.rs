//! `ringtool decode` / `ringtool encode`: the wire and shared-memory records of
//! `umbp-protocol` as JSON and back. Decoding shows every field (and readable names for
//! enum-like ones); encoding takes the same JSON (missing fields are zero), so a decoded
//! record re-encodes to the same bytes.

use bytemuck::{Pod, Zeroable};
use serde_json::{json, Map, Value};
use umbp_protocol::attachment::Hint;
use umbp_protocol::entries::{BlockRef, Cqe, CqeError, Opcode, Sqe};
use umbp_protocol::events::EventKind;
use umbp_protocol::index::{SLOT_EMPTY, SLOT_FULL, SLOT_TOMBSTONE};
use umbp_protocol::layout::Segment;
use umbp_protocol::location::{self, Tier};
use umbp_protocol::wire::{
    self, encode_message, Hello, HelloReply, LayoutHeader, MemoryKind, MemoryRegistration, MessageHeader, MessageKind, Reply, ReplyStatus,
    Role,
};
use umbp_protocol::ObjectKey;

/// Record types `decode` and `encode` understand.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RecordType {
    /// Submission queue entry (64 B).
    Sqe,
    /// Completion queue entry (32 B).
    Cqe,
    /// Arena entry of a submission: key + block id (24 B).
    Blockref,
    /// Touch hint on a scheduler's hint ring (16 B).
    Hint,
    /// Handshake, peer -> pool (88 B).
    Hello,
    /// Handshake answer, pool -> peer (256 B).
    HelloReply,
    /// Answer to a control message (208 B).
    Reply,
    /// RegisterMemory payload (120 B).
    #[value(alias = "memreg")]
    MemoryRegistration,
    /// RegisterLayout payload header (8 B).
    LayoutHeader,
    /// One KV layout segment (40 B).
    Segment,
    /// Socket message header (16 B).
    MessageHeader,
    /// Event log entry (32 B).
    Event,
    /// Index slot (32 B): its location word decoded into tier and payload.
    Slot,
    /// A whole socket message: header, then its payload decoded by kind.
    Message,
}

impl RecordType {
    pub fn size(self) -> Option<usize> {
        use std::mem::size_of;
        Some(match self {
            Self::Sqe => size_of::<Sqe>(),
            Self::Cqe => size_of::<Cqe>(),
            Self::Blockref => size_of::<BlockRef>(),
            Self::Hint => size_of::<Hint>(),
            Self::Hello => size_of::<Hello>(),
            Self::HelloReply => size_of::<HelloReply>(),
            Self::Reply => size_of::<Reply>(),
            Self::MemoryRegistration => size_of::<MemoryRegistration>(),
            Self::LayoutHeader => size_of::<LayoutHeader>(),
            Self::Segment => size_of::<Segment>(),
            Self::MessageHeader => size_of::<MessageHeader>(),
            Self::Event => size_of::<EventRecord>(),
            Self::Slot => size_of::<SlotRecord>(),
            Self::Message => return None,
        })
    }
}

/// The event log entry as plain bytes (the shared type is made of atomics).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable, PartialEq, Eq)]
pub struct EventRecord {
    pub stamp: u64,
    pub kind: u32,
    /// The tier the object entered or left (`Tier` as u32; 0, DRAM, before tiers existed).
    pub tier: u32,
    pub key: [u64; 2],
}
umbp_protocol::assert_layout!(EventRecord, size = 32, align = 8);

/// An index slot as plain bytes (the shared `IndexSlot` is made of atomics).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable, PartialEq, Eq)]
pub struct SlotRecord {
    pub seq: u32,
    pub state: u32,
    pub key: [u64; 2],
    pub location: u64,
}
umbp_protocol::assert_layout!(SlotRecord, size = 32, align = 8);

/// Name of a tier number as events and locations carry it ("unknown" for a newer pool's).
pub fn tier_name(t: u64) -> &'static str {
    u8::try_from(t).ok().and_then(Tier::from_u8).map_or("unknown", Tier::as_str)
}

/// `{tier, payload}` of an index location word (payload: the DRAM byte offset, the SSD
/// handle, ...); tier "unknown" for a tier this build does not know.
pub fn location_json(loc: u64) -> Value {
    match location::decode(loc) {
        Some((t, p)) => json!({ "tier": t.as_str(), "payload": p }),
        None => json!({ "tier": "unknown", "raw": format!("{loc:#018x}") }),
    }
}

/// A field that converts to and from JSON.
trait Field {
    fn to_json(&self) -> Value;
    fn set(&mut self, v: &Value) -> Result<(), String>;
}

fn json_int(v: &Value) -> Result<i128, String> {
    if let Some(n) = v.as_i64() {
        return Ok(n as i128);
    }
    if let Some(n) = v.as_u64() {
        return Ok(n as i128);
    }
    if let Some(s) = v.as_str() {
        let s = s.trim();
        let r = match s.strip_prefix("0x") {
            Some(h) => i128::from_str_radix(h, 16),
            None => s.parse(),
        };
        return r.map_err(|_| format!("{s:?} is not an integer"));
    }
    Err(format!("{v} is not an integer"))
}

macro_rules! int_field {
    ($($t:ty),*) => {$(
        impl Field for $t {
            fn to_json(&self) -> Value {
                json!(*self)
            }
            fn set(&mut self, v: &Value) -> Result<(), String> {
                let n = json_int(v)?;
                *self = <$t>::try_from(n).map_err(|_| format!("{n} does not fit {}", stringify!($t)))?;
                Ok(())
            }
        }
    )*};
}
int_field!(u8, u16, u32, u64, i32);

impl<const N: usize> Field for [u8; N] {
    fn to_json(&self) -> Value {
        Value::String(hex(self))
    }
    fn set(&mut self, v: &Value) -> Result<(), String> {
        let bytes = parse_hex(v.as_str().ok_or_else(|| format!("{v} is not a hex string"))?)?;
        if bytes.len() > N {
            return Err(format!("{} bytes do not fit a {N}-byte field", bytes.len()));
        }
        *self = [0; N];
        self[..bytes.len()].copy_from_slice(&bytes);
        Ok(())
    }
}

impl<const N: usize> Field for [u64; N] {
    fn to_json(&self) -> Value {
        Value::Array(self.iter().map(|w| json!(*w)).collect())
    }
    fn set(&mut self, v: &Value) -> Result<(), String> {
        let a = v.as_array().ok_or_else(|| format!("{v} is not an array"))?;
        if a.len() != N {
            return Err(format!("expected {N} words, got {}", a.len()));
        }
        for (w, x) in self.iter_mut().zip(a) {
            w.set(x)?;
        }
        Ok(())
    }
}

/// Generic struct <-> JSON over a list of fields.
macro_rules! record {
    ($to:ident, $from:ident, $t:ty { $($f:ident),* $(,)? }) => {
        fn $to(v: &$t) -> Map<String, Value> {
            let mut m = Map::new();
            $( m.insert(stringify!($f).to_string(), Field::to_json(&v.$f)); )*
            m
        }
        fn $from(j: &Value) -> Result<$t, String> {
            let mut v = <$t>::zeroed();
            $(
                if let Some(x) = j.get(stringify!($f)) {
                    Field::set(&mut v.$f, x).map_err(|e| format!("{}: {e}", stringify!($f)))?;
                }
            )*
            Ok(v)
        }
    };
}

record!(
    sqe_json,
    sqe_from,
    Sqe { opcode, flags, group, count, user_data, refs_offset, status_offset, fence_value, fence_ref, state_offset, reserved }
);
record!(cqe_json, cqe_from, Cqe { user_data, result, ok_count, failed_count, _pad, reserved });
record!(blockref_json, blockref_from, BlockRef { key, block_id });
record!(hint_json, hint_from, Hint { key });
record!(
    hello_json,
    hello_from,
    Hello { magic, protocol_version, role, pid, namespace, tp_rank, tp_size, dp_rank, sq_entries, arena_bytes, reserved }
);
record!(
    hello_reply_json,
    hello_reply_from,
    HelloReply {
        magic,
        protocol_version,
        status,
        attachment_id,
        sq_entries,
        cq_entries,
        hint_entries,
        pool_pid,
        arena_bytes,
        ring_region_bytes,
        index_region_bytes,
        event_log_bytes,
        message
    }
);
record!(reply_json, reply_from, Reply { status, _pad, value, message });
record!(memreg_json, memreg_from, MemoryRegistration { kind, alloc_id, device_uuid, ipc_handle, address, offset, size, reserved });
record!(layout_header_json, layout_header_from, LayoutHeader { group, segment_count });
record!(segment_json, segment_from, Segment { alloc_id, _pad, offset, block_stride, page_bytes, num_blocks });
record!(message_header_json, message_header_from, MessageHeader { magic, kind, len, fd_count });
record!(event_json, event_from, EventRecord { stamp, kind, tier, key });
record!(slot_json, slot_from, SlotRecord { seq, state, key, location });

fn key_hex(words: [u64; 2]) -> String {
    format!("{:032x}", ObjectKey::from_words(words).0)
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses hex text: whitespace, `:`/`,`/`_` separators and `0x` prefixes are ignored.
pub fn parse_hex(text: &str) -> Result<Vec<u8>, String> {
    let mut digits = String::with_capacity(text.len());
    for tok in text.split(|c: char| c.is_whitespace() || c == ':' || c == ',' || c == '_') {
        let tok = tok.strip_prefix("0x").or_else(|| tok.strip_prefix("0X")).unwrap_or(tok);
        digits.push_str(tok);
    }
    if !digits.len().is_multiple_of(2) {
        return Err(format!("odd number of hex digits ({})", digits.len()));
    }
    (0..digits.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&digits[i..i + 2], 16).map_err(|_| format!("not hex: {:?}", &digits[i..i + 2])))
        .collect()
}

fn name_or_unknown<T: std::fmt::Debug, E>(r: Result<T, E>) -> Value {
    match r {
        Ok(v) => Value::String(format!("{v:?}")),
        Err(_) => Value::String("unknown".into()),
    }
}

/// Decodes exactly one record of `ty` from `bytes` (which must be its size).
pub fn decode_one(ty: RecordType, bytes: &[u8]) -> Result<Value, String> {
    let m = match ty {
        RecordType::Sqe => {
            let v: Sqe = pod(bytes)?;
            let mut m = sqe_json(&v);
            m.insert("opcode_name".into(), name_or_unknown(Opcode::from_u8(v.opcode)));
            m
        }
        RecordType::Cqe => {
            let v: Cqe = pod(bytes)?;
            let mut m = cqe_json(&v);
            let r = if v.result == 0 {
                "ok".to_string()
            } else {
                CqeError::from_result(v.result).map_or("unknown".into(), |e| format!("{e:?}"))
            };
            m.insert("result_name".into(), r.into());
            if let Some(b) = v.busy_reason() {
                m.insert("busy_reason".into(), b.limit_name().into());
            }
            m
        }
        RecordType::Blockref => {
            let v: BlockRef = pod(bytes)?;
            let mut m = blockref_json(&v);
            m.insert("key_hex".into(), key_hex(v.key).into());
            m
        }
        RecordType::Hint => {
            let v: Hint = pod(bytes)?;
            let mut m = hint_json(&v);
            m.insert("key_hex".into(), key_hex(v.key).into());
            m
        }
        RecordType::Hello => {
            let v: Hello = pod(bytes)?;
            let mut m = hello_json(&v);
            m.insert("role_name".into(), name_or_unknown(Role::from_u32(v.role)));
            m.insert("namespace_hex".into(), format!("{:032x}", v.namespace()).into());
            m.insert("valid".into(), v.validate().map_or_else(|e| Value::String(e.to_string()), |_| Value::Bool(true)));
            m
        }
        RecordType::HelloReply => {
            let v: HelloReply = pod(bytes)?;
            let mut m = hello_reply_json(&v);
            m.insert("status_name".into(), format!("{:?}", ReplyStatus::from_u32(v.status)).into());
            m.insert("message_text".into(), v.message().into());
            m
        }
        RecordType::Reply => {
            let v: Reply = pod(bytes)?;
            let mut m = reply_json(&v);
            m.insert("status_name".into(), format!("{:?}", ReplyStatus::from_u32(v.status)).into());
            m.insert("message_text".into(), v.message().into());
            m
        }
        RecordType::MemoryRegistration => {
            let v: MemoryRegistration = pod(bytes)?;
            let mut m = memreg_json(&v);
            m.insert("kind_name".into(), name_or_unknown(MemoryKind::from_u32(v.kind)));
            m
        }
        RecordType::LayoutHeader => layout_header_json(&pod(bytes)?),
        RecordType::Segment => segment_json(&pod(bytes)?),
        RecordType::MessageHeader => {
            let v: MessageHeader = pod(bytes)?;
            let mut m = message_header_json(&v);
            m.insert("kind_name".into(), name_or_unknown(MessageKind::from_u32(v.kind)));
            m.insert("valid".into(), v.validate().map_or_else(|e| Value::String(e.to_string()), |_| Value::Bool(true)));
            m
        }
        RecordType::Event => {
            let v: EventRecord = pod(bytes)?;
            let mut m = event_json(&v);
            m.insert("kind_name".into(), EventKind::from_u32(v.kind).map_or("unknown", |k| k.as_str()).into());
            m.insert("tier_name".into(), tier_name(v.tier as u64).into());
            m.insert("key_hex".into(), key_hex(v.key).into());
            // stamp 2n+2 = event n complete, 2n+1 = being written, 0 = never written.
            let state = match v.stamp {
                0 => json!("empty"),
                s if s % 2 == 1 => json!({ "writing": (s - 1) / 2 }),
                s => json!({ "event": (s - 2) / 2 }),
            };
            m.insert("stamp_means".into(), state);
            m
        }
        RecordType::Slot => {
            let v: SlotRecord = pod(bytes)?;
            let mut m = slot_json(&v);
            let state = match v.state {
                SLOT_EMPTY => "empty",
                SLOT_FULL => "full",
                SLOT_TOMBSTONE => "tombstone",
                _ => "unknown",
            };
            m.insert("state_name".into(), state.into());
            m.insert("key_hex".into(), key_hex(v.key).into());
            m.insert("location_means".into(), location_json(v.location));
            m.insert("seq_means".into(), if v.seq % 2 == 1 { "being written" } else { "stable" }.into());
            m
        }
        RecordType::Message => return decode_message_bytes(bytes),
    };
    Ok(Value::Object(m))
}

fn pod<T: Pod>(bytes: &[u8]) -> Result<T, String> {
    wire::decode::<T>(bytes).map_err(|e| e.to_string())
}

/// A whole socket message: header + payload by kind.
fn decode_message_bytes(bytes: &[u8]) -> Result<Value, String> {
    let hlen = std::mem::size_of::<MessageHeader>();
    let header: MessageHeader = pod(bytes)?;
    let kind = header.validate().map_err(|e| format!("message header: {e}"))?;
    let payload = &bytes[hlen..];
    if payload.len() < header.len as usize {
        return Err(format!("payload truncated: header says {} bytes, got {}", header.len, payload.len()));
    }
    let payload = &payload[..header.len as usize];
    let size = |t: RecordType| t.size().expect("fixed size");
    let body = match kind {
        MessageKind::Hello => decode_one(RecordType::Hello, payload.get(..size(RecordType::Hello)).ok_or("short Hello")?)?,
        MessageKind::HelloReply => {
            decode_one(RecordType::HelloReply, payload.get(..size(RecordType::HelloReply)).ok_or("short HelloReply")?)?
        }
        MessageKind::RegisterMemory => decode_one(
            RecordType::MemoryRegistration,
            payload.get(..size(RecordType::MemoryRegistration)).ok_or("short MemoryRegistration")?,
        )?,
        MessageKind::RegisterLayout => {
            let h = size(RecordType::LayoutHeader);
            let header = decode_one(RecordType::LayoutHeader, payload.get(..h).ok_or("short LayoutHeader")?)?;
            let segs = payload[h..]
                .chunks(size(RecordType::Segment))
                .map(|c| decode_one(RecordType::Segment, c))
                .collect::<Result<Vec<_>, _>>()?;
            json!({ "header": header, "segments": segs })
        }
        MessageKind::Reply => {
            let r = size(RecordType::Reply);
            let reply = decode_one(RecordType::Reply, payload.get(..r).ok_or("short Reply")?)?;
            let rest = &payload[r..];
            let trailing = if rest.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(rest).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(rest).into_owned()))
            };
            json!({ "reply": reply, "trailing": trailing })
        }
        MessageKind::StatsRequest | MessageKind::ResetNamespace => Value::Null,
    };
    Ok(json!({
        "header": decode_one(RecordType::MessageHeader, &bytes[..hlen])?,
        "kind": format!("{kind:?}"),
        "payload": body,
    }))
}

/// Decodes consecutive records of `ty` filling `bytes` (one for `message`).
pub fn decode_all(ty: RecordType, bytes: &[u8]) -> Result<Vec<Value>, String> {
    let Some(size) = ty.size() else { return Ok(vec![decode_one(ty, bytes)?]) };
    if bytes.is_empty() || !bytes.len().is_multiple_of(size) {
        return Err(format!("{} bytes is not a whole number of {ty:?} records ({size} bytes each)", bytes.len()));
    }
    bytes.chunks_exact(size).map(|c| decode_one(ty, c)).collect()
}

/// Encodes one record of `ty` from JSON (as `decode_one` prints it; missing fields are 0,
/// readable extras like `opcode_name` are ignored, `message_text` sets `message`).
pub fn encode_one(ty: RecordType, j: &Value) -> Result<Vec<u8>, String> {
    if !j.is_object() {
        return Err("expected a JSON object".into());
    }
    let text = j.get("message_text").and_then(Value::as_str);
    Ok(match ty {
        RecordType::Sqe => bytemuck::bytes_of(&sqe_from(j)?).to_vec(),
        RecordType::Cqe => bytemuck::bytes_of(&cqe_from(j)?).to_vec(),
        RecordType::Blockref => bytemuck::bytes_of(&blockref_from(j)?).to_vec(),
        RecordType::Hint => bytemuck::bytes_of(&hint_from(j)?).to_vec(),
        RecordType::Hello => bytemuck::bytes_of(&hello_from(j)?).to_vec(),
        RecordType::HelloReply => {
            let mut v = hello_reply_from(j)?;
            if let Some(t) = text.filter(|_| j.get("message").is_none()) {
                v.message = encode_message(t);
            }
            bytemuck::bytes_of(&v).to_vec()
        }
        RecordType::Reply => {
            let mut v = reply_from(j)?;
            if let Some(t) = text.filter(|_| j.get("message").is_none()) {
                v.message = encode_message(t);
            }
            bytemuck::bytes_of(&v).to_vec()
        }
        RecordType::MemoryRegistration => bytemuck::bytes_of(&memreg_from(j)?).to_vec(),
        RecordType::LayoutHeader => bytemuck::bytes_of(&layout_header_from(j)?).to_vec(),
        RecordType::Segment => bytemuck::bytes_of(&segment_from(j)?).to_vec(),
        RecordType::MessageHeader => bytemuck::bytes_of(&message_header_from(j)?).to_vec(),
        RecordType::Event => bytemuck::bytes_of(&event_from(j)?).to_vec(),
        RecordType::Slot => bytemuck::bytes_of(&slot_from(j)?).to_vec(),
        RecordType::Message => return Err("encode a message-header and its payload separately".into()),
    })
}

/// Readable one-line-per-field rendering of decoded JSON.
pub fn render(v: &Value, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    match v {
        Value::Object(m) => {
            let width = m.keys().map(String::len).max().unwrap_or(0);
            for (k, x) in m {
                match x {
                    Value::Object(_) | Value::Array(_) if !is_flat_array(x) => {
                        out.push_str(&format!("{pad}{k}:\n"));
                        render(x, indent + 2, out);
                    }
                    _ => out.push_str(&format!("{pad}{k:<width$}  {}\n", scalar(x))),
                }
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                out.push_str(&format!("{pad}[{i}]\n"));
                render(x, indent + 2, out);
            }
        }
        x => out.push_str(&format!("{pad}{}\n", scalar(x))),
    }
}

fn is_flat_array(v: &Value) -> bool {
    v.as_array().is_some_and(|a| a.iter().all(|x| !x.is_object() && !x.is_array()))
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(a) => format!("[{}]", a.iter().map(scalar).collect::<Vec<_>>().join(", ")),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(ty: RecordType, bytes: &[u8]) {
        let j = decode_one(ty, bytes).unwrap();
        assert_eq!(encode_one(ty, &j).unwrap(), bytes, "{ty:?}: {j}");
        let h = hex(bytes);
        assert_eq!(decode_all(ty, &parse_hex(&h).unwrap()).unwrap(), vec![j]);
    }

    #[test]
    fn every_record_round_trips() {
        let sqe = Sqe {
            opcode: 1,
            flags: 2,
            group: 3,
            count: 4,
            user_data: u64::MAX,
            refs_offset: 4096,
            status_offset: 8192,
            fence_value: 7,
            fence_ref: 1,
            state_offset: 2,
            reserved: 3,
        };
        round_trip(RecordType::Sqe, bytemuck::bytes_of(&sqe));
        let j = decode_one(RecordType::Sqe, bytemuck::bytes_of(&sqe)).unwrap();
        assert_eq!(j["opcode_name"], "Store");
        let cqe = Cqe { user_data: 9, result: -(CqeError::Busy as i32), ok_count: 1, failed_count: 2, _pad: 0, reserved: 1 };
        round_trip(RecordType::Cqe, bytemuck::bytes_of(&cqe));
        assert_eq!(decode_one(RecordType::Cqe, bytemuck::bytes_of(&cqe)).unwrap()["result_name"], "Busy");
        let br = BlockRef::new(ObjectKey(0x0123_4567_89ab_cdef_fedc_ba98_7654_3210), 42);
        round_trip(RecordType::Blockref, bytemuck::bytes_of(&br));
        assert_eq!(decode_one(RecordType::Blockref, bytemuck::bytes_of(&br)).unwrap()["key_hex"], "0123456789abcdeffedcba9876543210");
        round_trip(RecordType::Hint, bytemuck::bytes_of(&Hint { key: [5, 6] }));
        let mut hello = Hello::new(Role::Scheduler, 0xabcdef, 1234);
        hello.tp_rank = 1;
        hello.tp_size = 2;
        round_trip(RecordType::Hello, bytemuck::bytes_of(&hello));
        let hj = decode_one(RecordType::Hello, bytemuck::bytes_of(&hello)).unwrap();
        assert_eq!(hj["role_name"], "Scheduler");
        assert_eq!(hj["valid"], true);
        let mut hr = HelloReply::refusal(ReplyStatus::PermissionDenied, "uid 5 is not allowed");
        hr.event_log_bytes = 4096 + 32 * 1024;
        round_trip(RecordType::HelloReply, bytemuck::bytes_of(&hr));
        let hrj = decode_one(RecordType::HelloReply, bytemuck::bytes_of(&hr)).unwrap();
        assert_eq!(hrj["message_text"], "uid 5 is not allowed");
        assert_eq!(hrj["status_name"], "PermissionDenied");
        round_trip(RecordType::Reply, bytemuck::bytes_of(&Reply::error(ReplyStatus::InvalidRequest, "bad group")));
        let mut mr = MemoryRegistration::zeroed();
        mr.kind = MemoryKind::Cuda as u32;
        mr.device_uuid = [0xaa; 16];
        mr.ipc_handle[0] = 1;
        mr.size = 1 << 30;
        round_trip(RecordType::MemoryRegistration, bytemuck::bytes_of(&mr));
        round_trip(RecordType::LayoutHeader, bytemuck::bytes_of(&LayoutHeader { group: 1, segment_count: 2 }));
        let seg = Segment { alloc_id: 1, _pad: 0, offset: 0, block_stride: 4096, page_bytes: 2048, num_blocks: 10 };
        round_trip(RecordType::Segment, bytemuck::bytes_of(&seg));
        round_trip(RecordType::MessageHeader, bytemuck::bytes_of(&MessageHeader::new(MessageKind::Hello, 88, 0)));
        let ev = EventRecord { stamp: 2 * 7 + 2, kind: EventKind::Removed as u32, tier: 0, key: [1, 2] };
        round_trip(RecordType::Event, bytemuck::bytes_of(&ev));
        let ej = decode_one(RecordType::Event, bytemuck::bytes_of(&ev)).unwrap();
        assert_eq!(ej["kind_name"], "removed");
        assert_eq!(ej["tier_name"], "dram");
        assert_eq!(ej["stamp_means"]["event"], 7);
    }

    /// The tier of events and index locations is decoded (and an unknown one says so),
    /// and the bytes the pool writes (`EventLogWriter::push_tiered`, `location::encode`)
    /// decode to the tier they were written with.
    #[test]
    fn events_and_slots_show_their_tier() {
        let ev = EventRecord { stamp: 4, kind: EventKind::Stored as u32, tier: Tier::Ssd as u32, key: [3, 4] };
        round_trip(RecordType::Event, bytemuck::bytes_of(&ev));
        assert_eq!(decode_one(RecordType::Event, bytemuck::bytes_of(&ev)).unwrap()["tier_name"], "ssd");
        let ev = EventRecord { tier: 9, ..ev };
        assert_eq!(decode_one(RecordType::Event, bytemuck::bytes_of(&ev)).unwrap()["tier_name"], "unknown");
        // The same bytes as the pool's own event log entry.
        let mut region = vec![0u128; umbp_protocol::events::region_bytes(4) / 16 + 8];
        let p = ((region.as_mut_ptr() as usize + 127) & !127) as *mut u8;
        // SAFETY: p..p + region_bytes(4) lies inside `region` (8 spare words cover the
        // alignment); nothing else uses it.
        let log = unsafe { umbp_protocol::events::EventLog::init(p, umbp_protocol::events::region_bytes(4), 4) }.unwrap();
        let mut w = umbp_protocol::events::EventLogWriter::new(log);
        w.push_tiered(EventKind::Stored, ObjectKey(7), Tier::Ssd);
        // SAFETY: entry 0 starts at EVENT_ENTRIES_OFFSET inside the region.
        let entry = unsafe { std::slice::from_raw_parts(p.add(umbp_protocol::events::EVENT_ENTRIES_OFFSET), 32) };
        let j = decode_one(RecordType::Event, entry).unwrap();
        assert_eq!((j["tier_name"].as_str(), j["kind_name"].as_str()), (Some("ssd"), Some("stored")));

        for (tier, payload) in [(Tier::Dram, 1u64 << 30), (Tier::Ssd, 42), (Tier::Remote, 7)] {
            let s = SlotRecord { seq: 2, state: SLOT_FULL, key: [5, 6], location: location::encode(tier, payload) };
            round_trip(RecordType::Slot, bytemuck::bytes_of(&s));
            let j = decode_one(RecordType::Slot, bytemuck::bytes_of(&s)).unwrap();
            assert_eq!(j["state_name"], "full");
            assert_eq!(j["location_means"]["tier"], tier.as_str());
            assert_eq!(j["location_means"]["payload"], payload);
        }
        let s = SlotRecord { seq: 3, state: SLOT_TOMBSTONE, key: [0, 0], location: 15 << 60 };
        let j = decode_one(RecordType::Slot, bytemuck::bytes_of(&s)).unwrap();
        assert_eq!((j["state_name"].as_str(), j["seq_means"].as_str()), (Some("tombstone"), Some("being written")));
        assert_eq!(j["location_means"]["tier"], "unknown");
    }

    #[test]
    fn whole_messages_and_bad_input() {
        let hello = Hello::new(Role::Worker, 1, 2);
        let mut bytes = bytemuck::bytes_of(&MessageHeader::new(MessageKind::Hello, 88, 0)).to_vec();
        bytes.extend_from_slice(bytemuck::bytes_of(&hello));
        let m = decode_one(RecordType::Message, &bytes).unwrap();
        assert_eq!(m["kind"], "Hello");
        assert_eq!(m["payload"]["role_name"], "Worker");
        assert!(decode_one(RecordType::Message, &bytes[..40]).unwrap_err().contains("truncated"));
        assert!(decode_all(RecordType::Sqe, &[0; 65]).unwrap_err().contains("64 bytes each"));
        assert_eq!(parse_hex("0x01 02:03,0A").unwrap(), vec![1, 2, 3, 10]);
        assert!(parse_hex("123").is_err());
        assert!(parse_hex("zz").is_err());
        assert!(encode_one(RecordType::Sqe, &json!({"opcode": 300})).unwrap_err().contains("opcode"));
        assert_eq!(encode_one(RecordType::Sqe, &json!({"opcode": "0x2"})).unwrap()[0], 2);
    }
}
