//! The UMBP cluster tier (issue #17; docs/cluster.md): pools on several nodes share their
//! DRAM objects. Each pool advertises its keys to its peers over an authenticated control
//! connection; peers mirror them in their local index marked `Tier::Remote`, so a
//! scheduler finds a cross-node hit with a local lookup; a load of a remote hit pins the
//! object at its holder and pulls it over NIXL (READ) into local DRAM.
//!
//! One concern per file: `transport` (NIXL, dlopened only when a node starts),
//! `membership` (discovery seam + heartbeat liveness), `discovery` (etcd), `channel` (the Noise channel:
//! handshake keyed by the secret, sealed records), `control` (framing, messages),
//! `export` (the export area: the only memory peers can reach; copy-on-pin slots),
//! `catalog` (who holds what → index changes), `placement` (which holder a load pulls
//! from), `outbox` (a connection's queued writes, so no shared thread ever waits on a
//! peer's socket), `node` (the running node tying them together).

pub mod catalog;
pub mod channel;
pub mod control;
pub mod discovery;
pub mod export;
#[cfg(feature = "test-util")]
pub mod mem_pool;
pub mod membership;
pub mod node;
pub mod outbox;
pub mod placement;
pub mod pool_tier;
pub mod transport;

pub use node::{Cluster, ClusterConfig, ClusterError, ClusterStats, FetchError, FetchRequest, LocalPool, Pin};
