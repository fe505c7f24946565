//! UMBP tools: `umbp-bench` (benchmarks with one output convention, DESIGN §12) and
//! `ringtool` (see inside a live pool). The binaries in `src/bin/` only parse the command
//! line; everything else lives here so that tests can call it.

pub mod bench;
pub mod ringtool;
