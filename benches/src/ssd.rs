//! `umbp-bench ssd`: the SSD tier's store (`umbp_ssd`) against raw io_uring O_DIRECT of
//! the same bytes in the same directory, and its warm restart (index rebuild after reopen).

use std::path::PathBuf;

use umbp_ssd::{bench::run as measure, SsdConfig};

use crate::report::{Better, Case};

/// What to measure.
pub struct SsdArgs {
    /// Directory on the drive to measure (a scratch subdirectory is made and removed).
    pub dir: PathBuf,
    pub bytes: u64,
    pub object_bytes: u64,
    pub batch: usize,
    /// Objects of one 4 KiB block each for the warm-restart case (0: skip it).
    pub rebuild_objects: u64,
    /// Pool DRAM of the admission cases (ssd_wear.rs; 0: skip them).
    pub admission_dram: u64,
}

/// Runs both phases and returns the cases (docs/benchmarks.md convention).
pub fn run(args: &SsdArgs) -> Result<Vec<Case>, String> {
    let scratch = tempfile::Builder::new()
        .prefix("umbp-bench-ssd")
        .tempdir_in(&args.dir)
        .map_err(|e| format!("cannot make a scratch directory in {}: {e}", args.dir.display()))?;
    let cfg = SsdConfig::default();
    let r = measure(scratch.path(), args.bytes, args.object_bytes, args.batch.max(1), &cfg).map_err(|e| e.to_string())?;
    let ctx = serde_json::to_value(&r).map_err(|e| e.to_string())?;
    let ctx = ctx.as_object().cloned().unwrap_or_default();
    let mut cases = vec![
        Case::new(
            "ssd",
            "ssd_write_gbps",
            r.ssd_write_gbps,
            "GB/s",
            r.raw_write_gbps,
            "raw io_uring O_DIRECT write, same bytes, same directory",
            Better::Higher,
        )
        .extras(&ctx),
        Case::new(
            "ssd",
            "ssd_read_gbps",
            r.ssd_read_gbps,
            "GB/s",
            r.raw_read_gbps,
            "raw io_uring O_DIRECT read, same bytes, same directory",
            Better::Higher,
        )
        .extras(&ctx),
    ];
    if args.rebuild_objects > 0 {
        // One 4 KiB block per object (header included), the worst case for the rebuild.
        let small = 4096 - umbp_ssd::format::HEADER_BYTES as u64;
        let r = measure(scratch.path(), args.rebuild_objects * small, small, 256, &cfg).map_err(|e| e.to_string())?;
        let ctx = serde_json::to_value(&r).map_err(|e| e.to_string())?;
        let ctx = ctx.as_object().cloned().unwrap_or_default();
        // Baseline: reading every byte back at the raw rate (what a rebuild without footers costs).
        let scan_ms = r.bytes as f64 / (r.raw_read_gbps * 1e9) * 1e3;
        cases.push(
            Case::new(
                "ssd",
                "warm_restart_ms",
                r.warm_restart_ms,
                "ms",
                scan_ms,
                "raw O_DIRECT read of every byte (a full scan)",
                Better::Lower,
            )
            .extra("per_million_objects_ms", r.warm_restart_ms_per_million)
            .extras(&ctx),
        );
        cases.push(
            Case::new(
                "ssd",
                "warm_restart_hits",
                r.warm_restart_hits,
                "fraction",
                1.0,
                "every object written before the reopen",
                Better::Higher,
            )
            .extras(&ctx),
        );
    }
    if args.admission_dram > 0 {
        let wear = crate::ssd_wear::WearArgs { dram_bytes: args.admission_dram, object_bytes: 64 << 10, stream_factor: 8 };
        cases.extend(crate::ssd_wear::run(scratch.path(), &wear)?);
    }
    Ok(cases)
}
