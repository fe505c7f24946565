//! The test kit of the multi-process tests (this crate's `tests/`, `pool/tests`,
//! `worker/tests`): `umbp-pool` processes on private sockets ([`PoolProcess`]), the typed
//! state-report client ([`report()`]), the block pattern ([`fill_pattern`]), workers on
//! memfd KV ([`worker_on_memfd`]) and [`eventually`]. The crate's binaries are the test worker and the attacker.

pub mod cluster;
pub mod etcd;
pub mod metrics;
pub mod pattern;
pub mod process;
pub mod report;
pub mod root;
pub mod wait;
pub mod worker;

pub use pattern::{fill_pattern, verify_pattern};
pub use process::{kill_and_clean, pool_binary, pool_command, pool_wrapper, stop_gracefully, unique_socket, workspace_binary, PoolProcess};
pub use report::{report, report_json, try_report};
pub use root::root_or_skip;
pub use wait::{eventually, thread_cpu_ms, wait_until};
pub use worker::worker_on_memfd;
