//! Benchmarks behind `umbp-bench` (DESIGN §12). Each submodule measures one subsystem and
//! returns [`report::Case`]s; [`report`] prints them as JSON lines or a table.

pub mod index;
pub mod lookup;
pub mod multi_gpu;
pub mod report;
pub mod ring;
pub mod shm;
pub mod soak;
pub mod transfer;
