//! `umbp-pool`: the node-local KV-cache pool daemon. The command line (clap, every flag
//! also read from its `UMBP_*` variable), logging to stderr, the prefault progress bar and
//! signal handling live here; the pool itself is the `umbp-pool` library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

mod cluster_flags;
mod settings_args;
use umbp_pool::config::{self, settings, SsdSettings};
use umbp_pool::{parse_fraction, parse_size, Pool, PoolConfig, ProgressFn};

/// The node-local KV-cache pool that LLM serving engines share.
///
/// Every flag can also be set through the environment variable named in brackets; a flag
/// on the command line wins over the environment. Logs go to stderr; set RUST_LOG
/// (e.g. RUST_LOG=umbp_pool=debug) for more.
// Defaults, variables, value names, help and sections come from the settings table
// (settings_args.rs); the attributes here say only how each value is parsed.
#[derive(Parser, Debug)]
#[command(name = "umbp-pool", version, about, long_about)]
struct Args {
    #[arg(long, value_parser = parse_socket)]
    socket: Option<PathBuf>,
    #[arg(long)]
    capacity: Option<String>,
    #[arg(long = "high-wm")]
    high_wm: String,
    #[arg(long = "low-wm")]
    low_wm: String,
    #[arg(long, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new())]
    hugepages: bool,
    #[arg(long = "numa-node")]
    numa_node: Option<u32>,
    #[arg(long, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new())]
    prefault: bool,
    #[arg(long = "allow-uid")]
    allow_uid: Vec<u32>,
    #[arg(long = "min-object-size")]
    min_object_size: String,
    #[arg(long = "lease-ms")]
    lease_ms: u64,
    #[arg(long = "copy-threads")]
    copy_threads: Option<usize>,
    #[arg(long = "copy-threads-per-peer")]
    copy_threads_per_peer: usize,
    #[arg(long = "store-fence-timeout-ms")]
    store_fence_timeout_ms: u64,
    #[arg(long = "copy-stage-size")]
    copy_stage_size: String,
    #[arg(long = "copy-stage-growth", value_parser = table_parser(config::parse_growth))]
    copy_stage_growth: u32,
    #[arg(long = "promotion-ahead")]
    promotion_ahead: String,
    #[arg(long = "quarantine-max-size")]
    quarantine_max_size: Option<String>,
    #[arg(long = "idle-poll-us")]
    idle_poll_us: config::IdlePoll,
    #[arg(long = "copy-streams", value_parser = clap::value_parser!(u16).range(1..=16))]
    copy_streams: u16,
    #[arg(long = "copy-batch", action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new())]
    copy_batch: bool,
    #[arg(long = "copy-batch-max", value_parser = clap::value_parser!(u32).range(1..=65536))]
    copy_batch_max: u32,
    #[arg(long = "copy-parallel-submit", action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new())]
    copy_parallel_submit: bool,
    #[arg(long = "copy-kernel", value_parser = table_parser(config::parse_copy_kernel))]
    copy_kernel: umbp_gpu::GatherMode,
    #[arg(long = "copy-kernel-blocks", value_parser = clap::value_parser!(u32).range(0..=4096))]
    copy_kernel_blocks: u32,
    #[arg(long = "copy-kernel-launch-size")]
    copy_kernel_launch_size: String,
    #[arg(long = "copy-split-streams", value_parser = clap::value_parser!(u16).range(0..=16))]
    copy_split_streams: u16,
    #[arg(long = "socket-group")]
    socket_group: Option<String>,
    #[arg(long = "namespace-acl")]
    namespace_acl: Vec<String>,
    #[arg(long = "peer-pidfd-fallback", hide = true)]
    peer_pidfd_fallback: bool,
    #[arg(long = "max-attachments")]
    max_attachments: usize,
    #[arg(long = "max-attachments-per-uid")]
    max_attachments_per_uid: usize,
    #[arg(long = "max-registered-bytes")]
    max_registered_bytes: String,
    #[arg(long = "max-regions")]
    max_regions: usize,
    #[arg(long = "max-layouts")]
    max_layouts: usize,
    #[arg(long = "max-inflight")]
    max_inflight: u32,
    #[arg(long = "max-inflight-bytes")]
    max_inflight_bytes: String,
    #[arg(long = "max-arena-bytes")]
    max_arena_bytes: String,
    #[arg(long = "max-sq-entries")]
    max_sq_entries: u32,
    #[arg(long = "namespace-share")]
    namespace_share: String,
    #[arg(long = "lease-share")]
    lease_share: String,
    #[arg(long = "max-regions-per-uid")]
    max_regions_per_uid: Option<usize>,
    #[arg(long = "max-registered-bytes-per-uid")]
    max_registered_bytes_per_uid: Option<String>,
    #[arg(long = "max-layouts-per-uid")]
    max_layouts_per_uid: Option<usize>,
    #[arg(long = "max-handshakes-per-uid")]
    max_handshakes_per_uid: usize,
    #[arg(long = "max-handshakes")]
    max_handshakes: usize,
    #[arg(long = "handshake-timeout-ms")]
    handshake_timeout_ms: u64,
    #[arg(long = "control-timeout-ms")]
    control_timeout_ms: u64,
    #[arg(long = "fd-reserve")]
    fd_reserve: u64,
    #[arg(long = "metrics-addr")]
    metrics_addr: Option<String>,
    #[arg(long = "metrics-group")]
    metrics_group: Option<String>,
    #[arg(long = "ssd-dir", value_delimiter = ',')]
    ssd_dir: Vec<PathBuf>,
    #[arg(long = "ssd-capacity")]
    ssd_capacity: Option<String>,
    #[arg(long = "ssd-high-watermark")]
    ssd_high_wm: String,
    #[arg(long = "ssd-low-watermark")]
    ssd_low_wm: String,
    #[arg(long = "ssd-direct-io", num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new())]
    ssd_direct_io: bool,
    #[arg(long = "ssd-admission")]
    ssd_admission: String,
    #[arg(long = "ssd-segment-size")]
    ssd_segment_size: Option<String>,
    #[arg(long = "ssd-queue-depth", value_parser = clap::value_parser!(u32).range(1..=4096))]
    ssd_queue_depth: u32,
    #[arg(long = "ssd-flush-on-stop")]
    ssd_flush_on_stop: String,
    #[arg(long = "ssd-sync-interval")]
    ssd_sync_interval: String,
    #[command(flatten)]
    cluster: cluster_flags::ClusterArgs,
}

/// A pool config parser (`fn(key, value)`) as a clap value parser: clap's error names the
/// flag, so the key is left empty.
fn table_parser<T: Clone + Send + Sync + 'static>(
    parse: fn(&str, &str) -> Result<T, umbp_pool::ConfigError>,
) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static {
    move |v| {
        parse("", v).map_err(|e| match e {
            umbp_pool::ConfigError::Invalid { message, .. } => message,
            other => other.to_string(),
        })
    }
}

/// The SSD tier's settings from the `--ssd-*` flags; None without `--ssd-dir`. The
/// directories are checked by `PoolConfig::validate`.
fn ssd_config(args: &Args) -> anyhow::Result<Option<umbp_ssd::SsdConfig>> {
    use settings::*;
    let label = |s: &Setting| s.label();
    let settings = SsdSettings {
        dirs: args.ssd_dir.clone(),
        capacity_bytes: args.ssd_capacity.as_deref().map(|v| parse_size(&label(&SSD_CAPACITY), v)).transpose()?,
        high_watermark: Some(parse_fraction(&label(&SSD_HIGH_WM), &args.ssd_high_wm)?),
        low_watermark: Some(parse_fraction(&label(&SSD_LOW_WM), &args.ssd_low_wm)?),
        direct_io: Some(args.ssd_direct_io),
        admission: Some(umbp_ssd::SsdAdmission::parse(&label(&SSD_ADMISSION), &args.ssd_admission)?),
        segment_bytes: args.ssd_segment_size.as_deref().map(|v| parse_size(&label(&SSD_SEGMENT_SIZE), v)).transpose()?,
        queue_depth: Some(args.ssd_queue_depth),
        flush_on_stop: Some(config::parse_seconds(&label(&SSD_FLUSH_ON_STOP), &args.ssd_flush_on_stop)?),
        sync_interval: Some(config::parse_seconds(&label(&SSD_SYNC_INTERVAL), &args.ssd_sync_interval)?),
    };
    Ok(settings.resolve()?)
}

/// `--socket` / `UMBP_STANDALONE_ADDRESS`: a path or `unix://` address (the one parser all
/// endpoint readers share; its message names the flag and the variable).
fn parse_socket(value: &str) -> Result<PathBuf, String> {
    umbp_ipc::endpoint::parse_endpoint(&settings::SOCKET.label(), std::ffi::OsStr::new(value)).map_err(|e| e.to_string())
}

fn config_from(args: Args) -> anyhow::Result<PoolConfig> {
    use settings::*;
    let label = |s: &Setting| s.label();
    let size = |s: &Setting, v: &str| parse_size(&s.label(), v);
    let mut c = PoolConfig { ssd: ssd_config(&args)?, ..Default::default() };
    if let Some(s) = args.socket {
        c.socket_path = s;
    }
    if let Some(cap) = args.capacity {
        c.capacity_bytes = size(&CAPACITY, &cap)?;
    }
    c.high_watermark = parse_fraction(&label(&HIGH_WM), &args.high_wm)?;
    c.low_watermark = parse_fraction(&label(&LOW_WM), &args.low_wm)?;
    c.hugepages = args.hugepages;
    c.numa_node = args.numa_node;
    c.prefault = args.prefault;
    c.allow_uids = args.allow_uid;
    c.min_object_bytes = size(&MIN_OBJECT_SIZE, &args.min_object_size)?;
    c.lease = std::time::Duration::from_millis(args.lease_ms);
    if let Some(n) = args.copy_threads {
        c.copy_threads = n;
    }
    c.copy_threads_per_peer = args.copy_threads_per_peer;
    c.store_fence_timeout = std::time::Duration::from_millis(args.store_fence_timeout_ms);
    c.copy_stage_bytes = size(&COPY_STAGE_SIZE, &args.copy_stage_size)?;
    c.copy_stage_growth_percent = args.copy_stage_growth;
    c.promotion_ahead_bytes = size(&PROMOTION_AHEAD, &args.promotion_ahead)?;
    c.quarantine_max_bytes = args.quarantine_max_size.as_deref().map(|v| size(&QUARANTINE_MAX_SIZE, v)).transpose()?;
    c.idle_poll = args.idle_poll_us;
    c.engine.streams = args.copy_streams.into();
    c.engine.batch = args.copy_batch;
    c.engine.batch_max = args.copy_batch_max as usize;
    c.engine.parallel_submit = args.copy_parallel_submit;
    c.engine.gather.mode = args.copy_kernel;
    c.engine.gather.blocks = args.copy_kernel_blocks;
    c.engine.gather.launch_bytes = usize::try_from(size(&COPY_KERNEL_LAUNCH_SIZE, &args.copy_kernel_launch_size)?)
        .map_err(|_| anyhow::anyhow!("{}: too large", label(&COPY_KERNEL_LAUNCH_SIZE)))?;
    c.engine.gather.split_streams = args.copy_split_streams.into();
    if let Some(g) = &args.socket_group {
        c.socket_group = Some(config::parse_group(&label(&SOCKET_GROUP), g)?);
    }
    c.peer_pidfd_fallback = args.peer_pidfd_fallback;
    for acl in &args.namespace_acl {
        let (uid, namespaces) = config::parse_namespace_acl(&label(&NAMESPACE_ACL), acl)?;
        c.namespace_acl.entry(uid).or_default().extend(namespaces);
    }
    c.max_attachments = args.max_attachments;
    c.limits = umbp_pool::PeerLimits {
        attachments_per_uid: args.max_attachments_per_uid,
        registered_bytes: size(&MAX_REGISTERED_BYTES, &args.max_registered_bytes)?,
        regions: args.max_regions,
        layouts: args.max_layouts,
        inflight: args.max_inflight,
        inflight_bytes: size(&MAX_INFLIGHT_BYTES, &args.max_inflight_bytes)?,
        arena_bytes: size(&MAX_ARENA_BYTES, &args.max_arena_bytes)?,
        sq_entries: args.max_sq_entries,
    };
    let four = umbp_pool::UidLimits::four_times(&c.limits);
    c.uid_limits = umbp_pool::UidLimits {
        regions: args.max_regions_per_uid.unwrap_or(four.regions),
        registered_bytes: match &args.max_registered_bytes_per_uid {
            Some(v) => size(&MAX_REGISTERED_BYTES_PER_UID, v)?,
            None => four.registered_bytes,
        },
        layouts: args.max_layouts_per_uid.unwrap_or(four.layouts),
    };
    c.control = umbp_pool::ControlLimits {
        handshake_timeout: std::time::Duration::from_millis(args.handshake_timeout_ms),
        message_timeout: std::time::Duration::from_millis(args.control_timeout_ms),
        max_handshakes: args.max_handshakes,
        handshakes_per_uid: args.max_handshakes_per_uid,
        fd_reserve: args.fd_reserve,
    };
    c.metrics_addr = args.metrics_addr.filter(|a| !a.is_empty());
    if let Some(g) = args.metrics_group.as_deref().filter(|g| !g.is_empty()) {
        c.metrics_group = Some(config::parse_group(&label(&METRICS_GROUP), g)?);
    }
    c.namespace_share = parse_fraction(&label(&NAMESPACE_SHARE), &args.namespace_share)?;
    c.lease_share = parse_fraction(&label(&LEASE_SHARE), &args.lease_share)?;
    c.validate()?;
    c.progress = Some(progress_bar());
    Ok(c)
}

/// Blocks SIGINT/SIGTERM in every thread and returns when one arrives.
/// Draws the prefault progress on stderr (hidden when stderr is not a terminal).
fn progress_bar() -> ProgressFn {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(indicatif::ProgressStyle::with_template("{msg} {bar:40} {bytes}/{total_bytes} ({eta})").expect("static template"));
    ProgressFn::new(move |p| {
        bar.set_message(p.what);
        bar.set_length(p.total_bytes);
        bar.set_position(p.done_bytes);
        if p.done_bytes >= p.total_bytes {
            bar.finish_and_clear();
        }
    })
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args: Args = settings_args::parse();
    let cluster = match args.cluster.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("umbp-pool: {e:#}");
            return ExitCode::from(2);
        }
    };
    let config = match config_from(args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("umbp-pool: {e:#}");
            return ExitCode::from(2);
        }
    };
    if umbp_pool::FAULT_INJECTION {
        tracing::warn!("this umbp-pool was built with the umbp-pool library's fault-injection feature (a test build); build it alone (`cargo build --release -p umbp-pool-daemon`) for production");
    }
    if config.ssd.is_some() {
        // A segment write past RLIMIT_FSIZE must fail with EFBIG (the object is not
        // stored, docs/ssd.md) instead of killing the pool with SIGXFSZ.
        // SAFETY: setting a signal's disposition to ignore has no memory preconditions.
        unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    }
    // Before any thread starts, so all inherit the mask and only the wait below sees it.
    let stop = umbp_pool::StopSignals::block();
    // PoolError's message carries its cause already: print it once, not the chain.
    let pool = match Pool::start(config) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("umbp-pool: {e}");
            return ExitCode::from(1);
        }
    };
    let tier = match cluster.map(|(c, peers, opts)| cluster_flags::start(&pool, c, peers, opts)).transpose() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("umbp-pool: {e:#}");
            pool.shutdown();
            return ExitCode::from(1);
        }
    };
    let sig = stop.wait();
    tracing::info!(signal = sig, "shutting down");
    drop(tier);
    pool.shutdown();
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every flag of `umbp-pool --help` has its row in the settings table and takes its
    /// default, variable, value name, help and section from it; every row is a flag.
    #[test]
    fn every_flag_comes_from_the_settings_table() {
        let mut cmd = settings_args::command::<Args>();
        cmd.build();
        let help = cmd.render_long_help().to_string();
        let mut flags = std::collections::BTreeSet::new();
        for a in cmd.get_arguments() {
            let Some(flag) = a.get_long().filter(|f| !["help", "version"].contains(f)) else { continue };
            let row = settings::by_flag(flag).unwrap_or_else(|| panic!("--{flag} has no row"));
            flags.insert(flag);
            assert_eq!(a.get_help().map(|h| h.to_string()).as_deref(), Some(row.help), "--{flag}: help");
            assert_eq!(a.get_env().and_then(|e| e.to_str()), row.env, "--{flag}: variable");
            let defaults: Vec<_> = a.get_default_values().iter().map(|d| d.to_str().unwrap()).collect();
            assert_eq!(defaults, row.default.into_iter().collect::<Vec<_>>(), "--{flag}: default");
            assert_eq!(a.get_help_heading(), row.heading, "--{flag}: section");
            if a.get_action().takes_values() {
                let names: Vec<_> = a.get_value_names().unwrap_or_default().iter().map(|n| n.as_str()).collect();
                assert_eq!(names, [row.kind], "--{flag}: value name");
            }
            if !a.is_hide_set() {
                assert!(help.contains(&format!("--{flag}")), "--{flag} missing from --help");
                if let Some(env) = row.env {
                    assert!(help.contains(&format!("[env: {env}=")), "--{flag}: {env} missing from --help");
                }
            }
        }
        let rows: std::collections::BTreeSet<_> = settings::ALL.iter().map(|s| s.flag).collect();
        assert_eq!(flags, rows, "the daemon's flags are the table's rows");
    }

    /// With every flag left out the daemon's config is `PoolConfig::default()`: both read
    /// the same table.
    #[test]
    fn table_defaults_reach_the_config() {
        let d = config_from(settings_args::try_parse_from::<Args, _, _>(["umbp-pool"]).unwrap()).unwrap();
        let p = PoolConfig::default();
        assert_eq!(
            (d.high_watermark, d.low_watermark, d.min_object_bytes, d.lease),
            (p.high_watermark, p.low_watermark, p.min_object_bytes, p.lease)
        );
        assert_eq!((d.limits.clone(), d.uid_limits.clone(), d.control.clone()), (p.limits, p.uid_limits, p.control));
        assert_eq!(
            (d.copy_stage_bytes, d.promotion_ahead_bytes, d.idle_poll, d.engine),
            (p.copy_stage_bytes, p.promotion_ahead_bytes, p.idle_poll, p.engine)
        );
        assert_eq!(
            (d.namespace_share, d.lease_share, d.hugepages, d.prefault),
            (p.namespace_share, p.lease_share, p.hugepages, p.prefault)
        );
    }

    /// The GPU copy engine's flags (and, through clap, their env vars) reach the config
    /// passed to the pool; out-of-range values are refused naming the flag.
    #[test]
    fn copy_engine_flags_reach_the_config() {
        let parse = |extra: &[&str]| settings_args::try_parse_from::<Args, _, _>(["umbp-pool"].iter().chain(extra));
        let c = config_from(
            parse(&["--copy-streams", "4", "--copy-batch", "0", "--copy-batch-max", "64", "--copy-parallel-submit", "1"]).unwrap(),
        )
        .unwrap();
        assert_eq!((c.engine.streams, c.engine.batch, c.engine.batch_max, c.engine.parallel_submit), (4, false, 64, true));
        let g = config_from(parse(&[]).unwrap()).unwrap().engine.gather;
        assert_eq!(g, umbp_gpu::GatherConfig::default(), "page copy kernel defaults");
        let growth = |extra: &[&str]| config_from(parse(extra).unwrap()).unwrap().copy_stage_growth_percent;
        assert_eq!(growth(&[]), umbp_pool::config::AUTO_COPY_STAGE_GROWTH, "auto by default");
        assert_eq!(growth(&["--copy-stage-growth", "auto"]), umbp_pool::config::AUTO_COPY_STAGE_GROWTH);
        assert_eq!(growth(&["--copy-stage-growth", "125"]), 125);
        let poll = |extra: &[&str]| config_from(parse(extra).unwrap()).unwrap().idle_poll;
        assert_eq!(poll(&[]), umbp_pool::config::DEFAULT_IDLE_POLL);
        assert_eq!(poll(&["--idle-poll-us", "auto"]), umbp_pool::config::IdlePoll::Auto { max: umbp_pool::config::AUTO_IDLE_POLL_MAX });
        assert_eq!(poll(&["--idle-poll-us", "20000"]), umbp_pool::config::IdlePoll::Fixed(std::time::Duration::from_millis(20)));
        assert_eq!(poll(&["--idle-poll-us", "0"]), umbp_pool::config::IdlePoll::Fixed(std::time::Duration::ZERO));
        let g = config_from(
            parse(&[
                "--copy-kernel", "copy-engine", "--copy-kernel-blocks", "12", "--copy-kernel-launch-size", "4MiB", "--copy-split-streams",
                "4",
            ])
            .unwrap(),
        )
        .unwrap()
        .engine
        .gather;
        assert_eq!((g.mode, g.blocks, g.launch_bytes, g.split_streams), (umbp_gpu::GatherMode::CopyEngine, 12, 4 << 20, 4));
        let g = config_from(parse(&["--copy-kernel", "kernel"]).unwrap()).unwrap().engine.gather;
        assert_eq!(g.mode, umbp_gpu::GatherMode::Kernel);
        let g = config_from(parse(&["--copy-kernel", "staged"]).unwrap()).unwrap().engine.gather;
        assert_eq!(g.mode, umbp_gpu::GatherMode::Staged);
        assert!(parse(&["--copy-kernel", "stage"]).is_err(), "an unknown mode is refused");
        let err = config_from(parse(&["--copy-kernel-launch-size", "lots"]).unwrap()).unwrap_err().to_string();
        assert!(err.contains("copy-kernel-launch-size"), "{err}");
        for bad in [
            ["--copy-streams", "0"],
            ["--copy-streams", "17"],
            ["--copy-batch-max", "0"],
            ["--copy-batch", "maybe"],
            ["--copy-kernel", "gpu"],
            ["--copy-split-streams", "17"],
            ["--copy-stage-growth", "99"],
            ["--copy-stage-growth", "1001"],
            ["--copy-stage-growth", "fast"],
            ["--idle-poll-us", "1000001"],
            ["--idle-poll-us", "1ms"],
            ["--idle-poll-us", "1.5"],
            ["--idle-poll-us", "Auto"],
        ] {
            let err = parse(&bad).unwrap_err().to_string();
            assert!(err.contains(bad[0]), "{bad:?}: {err}");
        }
    }

    /// The SSD flags reach the config; a missing directory, a file, a read-only directory
    /// and bad values are refused naming the flag and the path.
    #[test]
    fn ssd_flags_reach_the_config_and_bad_dirs_are_named() {
        let parse = |extra: &[&str]| settings_args::try_parse_from::<Args, _, _>(["umbp-pool"].iter().chain(extra));
        assert!(config_from(parse(&[]).unwrap()).unwrap().ssd.is_none());
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let (pa, pb) = (a.path().to_str().unwrap(), b.path().to_str().unwrap());
        let c = config_from(
            parse(&[
                "--ssd-dir", pa, "--ssd-dir", pb, "--ssd-capacity", "2GiB", "--ssd-high-watermark", "0.9", "--ssd-low-watermark", "0.5",
                "--ssd-direct-io", "false", "--ssd-admission", "hit-or-young:5", "--ssd-segment-size", "64MiB", "--ssd-queue-depth", "32",
                "--ssd-flush-on-stop", "2.5", "--ssd-sync-interval", "30",
            ])
            .unwrap(),
        )
        .unwrap()
        .ssd
        .unwrap();
        assert_eq!(c.dirs, vec![a.path().to_path_buf(), b.path().to_path_buf()]);
        assert_eq!((c.capacity_bytes, c.high_watermark, c.low_watermark, c.direct_io), (2 << 30, 0.9, 0.5, false));
        assert_eq!((c.segment_bytes, c.queue_depth, c.flush_on_stop), (64 << 20, 32, std::time::Duration::from_millis(2500)));
        assert_eq!(c.admission, umbp_ssd::SsdAdmission::HitOrYoung { young: std::time::Duration::from_secs(5) });
        assert_eq!(c.sync_interval, std::time::Duration::from_secs(30));
        // Defaults: capacity from the free space, admission hit-or-young.
        let c = config_from(parse(&["--ssd-dir", pa]).unwrap()).unwrap().ssd.unwrap();
        assert!(c.capacity_bytes >= 256 << 20 && c.direct_io);
        assert_eq!(c.admission, umbp_ssd::SsdAdmission::default());
        assert_eq!(c.flush_on_stop, umbp_ssd::DEFAULT_FLUSH_ON_STOP);
        assert_eq!(c.sync_interval, std::time::Duration::ZERO, "off unless asked for");
        let err = |extra: &[&str]| config_from(parse(extra).unwrap()).unwrap_err().to_string();
        for bad in ["-1", "soon", "1e9"] {
            let e = err(&["--ssd-dir", pa, &format!("--ssd-flush-on-stop={bad}")]);
            assert!(e.contains("ssd-flush-on-stop") && e.contains(bad), "{e}");
        }
        let missing = a.path().join("nope");
        let e = err(&["--ssd-dir", missing.to_str().unwrap()]);
        assert!(e.contains("ssd-dir") && e.contains(missing.to_str().unwrap()) && e.contains("No such file"), "{e}");
        let file = a.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        let e = err(&["--ssd-dir", file.to_str().unwrap()]);
        assert!(e.contains("ssd-dir") && e.contains("not a directory"), "{e}");
        let e = err(&["--ssd-dir", pa, "--ssd-admission", "sometimes"]);
        assert!(e.contains("ssd-admission"), "{e}");
        // Below one segment (at least 1 MiB) per directory.
        let e = err(&["--ssd-dir", pa, "--ssd-capacity", "512KiB"]);
        assert!(e.contains("ssd-capacity"), "{e}");
        let e = err(&["--ssd-dir", pa, "--ssd-capacity", "1GiB", "--ssd-high-watermark", "0.5", "--ssd-low-watermark", "0.8"]);
        assert!(e.contains("ssd-low-watermark"), "{e}");
        // Read-only: only observable when not root (root writes anyway).
        let ro = b.path().join("ro");
        std::fs::create_dir(&ro).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            let e = err(&["--ssd-dir", ro.to_str().unwrap()]);
            assert!(e.contains("ssd-dir") && e.contains("not writable"), "{e}");
        } else {
            eprintln!("skipped: read-only directory check (running as root)");
        }
        // The environment's comma-separated list.
        let c = settings_args::try_parse_from::<Args, _, _>(["umbp-pool", "--ssd-dir", &format!("{pa},{pb}"), "--ssd-capacity", "1GiB"])
            .unwrap();
        assert_eq!(config_from(c).unwrap().ssd.unwrap().dirs.len(), 2);
    }
}
