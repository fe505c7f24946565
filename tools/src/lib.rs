//! UMBP tools: `ringtool` (see inside a live pool, decode protocol records). The binary in
//! `src/bin/` only parses the command line; everything else lives here so that tests can
//! call it. The benchmarks are the `umbp-bench` crate in `benches/`.

pub mod ringtool;
