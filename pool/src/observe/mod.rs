//! What the pool tells about itself: the counters and latencies the data path updates,
//! the state report (`ringtool dump`, a peer's StatsRequest) and the Prometheus endpoint.
//! Imports tier/ and store/; peer/ and copy/ import it.

pub(crate) mod group_report;
pub(crate) mod metrics;
pub(crate) mod report;
pub(crate) mod stats;
