//! The SSD tier (issue #16, docs/ssd.md): an append-only segment log per drive, written and
//! read through io_uring with O_DIRECT, every record framed by CRC32C, rebuilt on start.
//!
//! The pool (`umbp-pool`) uses it through its `tier` module (demotion by the evictor,
//! promotion by loads, warm restart), configured by `PoolConfig::ssd`. The store needs nothing
//! of the pool: it is a crate of its own so the pool's tier seam is the only way in.
//!
//! Files: `config` (`SsdConfig` and its checks), `admission` (the demotion policy), `error`,
//! `format` (record header, footer; no I/O), `segment` (directories, files, O_DIRECT), `salt`
//! (the directory's secret for format 2's record tags), `uring`
//! (one ring per drive), `index` (the compact in-memory index entries), `shard` (one drive: segments, index, record I/O, capacity,
//! compaction), `rebuild` (warm restart of a shard), `store` (keys spread over shards;
//! put/get/remove in batches), `bench` (the measurements `umbp-bench ssd` reports).

mod admission;
pub mod bench;
mod config;
mod dir_files;
mod error;
pub mod format;
mod index;
mod rebuild;
pub mod salt;
pub mod segment;
mod shard;
mod store;
pub mod uring;

#[cfg(test)]
mod tests;

pub use admission::{SsdAdmission, DEFAULT_YOUNG};
pub use config::{SsdConfig, DEFAULT_FLUSH_ON_STOP};
pub use error::{InvalidSetting, SsdError};
pub use shard::PutOutcome;
pub use store::{SsdObjectInfo, SsdStats, SsdStore};
