//! Benchmarks behind `umbp-bench`, one output convention (docs/benchmarks.md). Each module
//! measures one subsystem and returns [`report::Case`]s; [`report`] prints them as JSON
//! lines or a table. The binary in `src/bin/` only parses the command line.

pub mod cluster;
pub mod cluster_pools;
pub mod cluster_setup;
pub mod index;
pub mod lookup;
pub mod multi_gpu;
pub mod report;
pub mod ring;
pub mod shm;
pub mod soak;
pub mod ssd;
pub mod ssd_wear;
pub mod transfer;
