//! The commands the `transfer` parent sends its worker children (`__transfer-worker`), one
//! JSON object per line on the child's stdin, tagged by `cmd`. Both sides use this one
//! type, so a command or field the child does not know is an error naming it (serde's
//! `deny_unknown_fields`), never a silent default. Replies are JSON objects (`error` on
//! failure) read by `super::parent::WorkerProc::recv`.

use serde::{Deserialize, Serialize};

/// Direction of a transfer.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    Store,
    Load,
}

/// Direction of a contiguous baseline copy (host backend: `d2h` and `h2d` are both one
/// memcpy of the same bytes).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum CopyDir {
    D2h,
    H2d,
    /// Both at once on two streams (cuda).
    Bidir,
}

/// How a layout's KV memory is allocated and cut into segments.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Shape {
    pub layers: u64,
    pub page: u64,
    /// Blocks in the cache (every segment has this many pages).
    pub blocks: u64,
    /// One allocation per layer (vLLM's per-layer KV tensors) instead of one for all.
    pub per_layer_alloc: bool,
    /// Segments per layer: 1 (K and V in one page) or 2 (K and V pages apart, as vLLM's
    /// `(2, num_blocks, ...)` tensors: all K pages of the layer, then all V pages).
    pub segments_per_layer: u64,
}

impl Shape {
    /// Bytes of one object (one block across every segment).
    pub fn object_bytes(&self) -> u64 {
        self.layers * self.segments_per_layer * self.page
    }
}

/// One transfer run: `rounds` x `blocks` (keys `key_base + round * round_stride + i`, or
/// `keys`) in transfers of `per_transfer` blocks with at most `inflight` outstanding.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Xfer {
    pub op: Op,
    pub group: u16,
    pub key_base: u64,
    pub blocks: Vec<u64>,
    pub per_transfer: usize,
    pub inflight: usize,
    pub rounds: u64,
    /// Key distance between rounds (default: the number of blocks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub round_stride: Option<u64>,
    /// Stream-ordered (cuda): `store_after_stream` / `load_before_stream`.
    #[serde(default)]
    pub fence: bool,
    /// Explicit keys (hex, one per block, e.g. per-rank keys) instead of `key_base`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<Vec<String>>,
}

impl Xfer {
    /// `blocks` in transfers of `per_transfer` with `inflight` outstanding, one round.
    pub fn new(op: Op, group: u16, key_base: u64, blocks: &[u64], per_transfer: usize, inflight: usize) -> Self {
        Xfer {
            op,
            group,
            key_base,
            blocks: blocks.to_vec(),
            per_transfer,
            inflight,
            rounds: 1,
            round_stride: None,
            fence: false,
            keys: None,
        }
    }
}

/// A command of the parent to a worker child.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(tag = "cmd", rename_all = "snake_case", deny_unknown_fields)]
pub enum Command {
    /// `{"gpu": name or null, "pid": n}`.
    Info,
    /// Allocate and register the memory of `group`, filled with pattern `seed`, and its
    /// layout; replies `{"object_bytes": n}`.
    Setup {
        group: u16,
        shape: Shape,
        seed: u64,
    },
    /// Forget `group` locally (registrations and memory stay: the pool may reference them).
    Drop {
        group: u16,
    },
    /// Drop this worker's namespace in the pool.
    Reset,
    Xfer(Xfer),
    /// Median ns of a contiguous copy of `bytes` (host: memcpy split over `threads`
    /// threads; cuda: pinned cuMemcpy, `threads` must be 1).
    Baseline {
        bytes: u64,
        dir: CopyDir,
        reps: usize,
        threads: usize,
    },
    /// Fill `group`'s memory with the poison byte.
    Poison {
        group: u16,
    },
    /// Fill `group`'s memory with pattern `seed`.
    Fill {
        group: u16,
        seed: u64,
    },
    /// Count words of `blocks`' pages that differ from pattern `seed`.
    Verify {
        group: u16,
        seed: u64,
        blocks: Vec<u64>,
    },
    /// Count words of `blocks`' pages that are not the poison byte.
    VerifyPoison {
        group: u16,
        blocks: Vec<u64>,
    },
    /// Every word of `group`'s memory: pattern `seed` in the pages of `blocks` (placed by
    /// the group's shape, not by what was registered), poison elsewhere.
    VerifyAll {
        group: u16,
        seed: u64,
        blocks: Vec<u64>,
    },
    /// Scheduler lookup of keys `key_base + i`, then one load of the hits; end to end.
    /// The index client is connected for this restore, or with `keep_index` kept from the
    /// last such restore (a scheduler that stays connected, as an engine's does).
    Restore {
        group: u16,
        key_base: u64,
        blocks: Vec<u64>,
        #[serde(default)]
        keep_index: bool,
    },
    /// Store `blocks` with fresh keys for `seconds`, one transfer in flight (replies
    /// `{"started": true}` first).
    StoreLoop {
        group: u16,
        key_base: u64,
        blocks: Vec<u64>,
        seconds: f64,
        no_reset: bool,
    },
    /// Contiguous pinned device-to-host copies for `seconds` (cuda).
    MemcpyLoop {
        bytes: u64,
        seconds: f64,
    },
    /// Store ordered after a slow kernel writing the KV, and an unfenced control (cuda).
    FenceStore {
        group: u16,
        old_seed: u64,
        new_seed: u64,
        spin_ms: u64,
        key_base: u64,
        control_key_base: u64,
    },
    /// Load ordered before a reading kernel, and an unfenced control (cuda).
    FenceLoad {
        group: u16,
        seed: u64,
        key_base: u64,
    },
    /// Leave the command loop.
    Exit,
}

impl Command {
    /// The JSON line sent to the child (without the newline).
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).expect("commands serialize")
    }

    /// Parses one line; an unknown command, an unknown field or a missing one is an error
    /// naming it.
    pub fn parse(line: &str) -> Result<Self, String> {
        serde_json::from_str(line).map_err(|e| format!("bad command {line:?}: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_round_trip() {
        let shape = Shape { layers: 80, page: 4096, blocks: 640, per_layer_alloc: true, segments_per_layer: 2 };
        let cmds = [
            Command::Info,
            Command::Setup { group: 3, shape, seed: 9 },
            Command::Xfer(Xfer { fence: true, round_stride: Some(7), ..Xfer::new(Op::Load, 1, 5, &[1, 2], 2, 1) }),
            Command::Baseline { bytes: 1 << 20, dir: CopyDir::Bidir, reps: 3, threads: 8 },
            Command::StoreLoop { group: 0, key_base: 1, blocks: vec![0], seconds: 1.5, no_reset: true },
            Command::Exit,
        ];
        for c in cmds {
            assert_eq!(Command::parse(&c.to_line()).expect("parses"), c);
        }
        assert_eq!(shape.object_bytes(), 80 * 2 * 4096);
    }

    /// A typo must fail, naming what was wrong, instead of silently becoming a default.
    #[test]
    fn unknown_commands_and_fields_are_errors() {
        let e = Command::parse(r#"{"cmd":"verfy","group":0,"seed":1,"blocks":[]}"#).unwrap_err();
        assert!(e.contains("verfy"), "{e}");
        let e = Command::parse(r#"{"cmd":"verify","group":0,"sed":1,"blocks":[]}"#).unwrap_err();
        assert!(e.contains("sed"), "{e}");
        let e = Command::parse(
            r#"{"cmd":"xfer","op":"store","group":0,"key_base":0,"blocks":[],"per_transfer":1,"inflight":1,"rounds":1,"fenced":true}"#,
        )
        .unwrap_err();
        assert!(e.contains("fenced"), "{e}");
        let e = Command::parse(r#"{"cmd":"poison"}"#).unwrap_err();
        assert!(e.contains("group"), "missing field named: {e}");
        let e = Command::parse(r#"{"cmd":"xfer","op":"stor","group":0,"key_base":0,"blocks":[],"per_transfer":1,"inflight":1,"rounds":1}"#)
            .unwrap_err();
        assert!(e.contains("stor"), "{e}");
        let e = Command::parse(r#"{"cmd":"setup","group":0,"seed":1,"shape":{"layers":1,"page":1,"blocks":1,"per_layer_alloc":false,"segments_per_layer":1,"kv":2}}"#)
            .unwrap_err();
        assert!(e.contains("kv"), "{e}");
    }
}
