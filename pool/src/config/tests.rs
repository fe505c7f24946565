use super::*;

#[test]
fn sizes() {
    assert_eq!(parse_size("k", "64GiB"), Ok(64 << 30));
    assert_eq!(parse_size("k", "64G"), Ok(64 << 30));
    assert_eq!(parse_size("k", "1.5 GiB"), Ok(3 << 29));
    assert_eq!(parse_size("k", "4096"), Ok(4096));
    assert_eq!(parse_size("k", "512mb"), Ok(512 << 20));
    let e = parse_size("capacity_bytes", "lots").unwrap_err();
    assert!(e.to_string().starts_with("capacity_bytes:"), "{e}");
    assert!(parse_size("k", "12XB").is_err());
    assert!(parse_size("k", "1.5").is_err());
    assert!(parse_size("k", "").is_err());
}

#[test]
fn fractions_and_relations() {
    assert_eq!(parse_fraction("high", "0.9"), Ok(0.9));
    assert!(parse_fraction("high", "1.5").unwrap_err().to_string().contains("high"));
    let mut c = PoolConfig { capacity_bytes: 64 << 20, ..Default::default() };
    c.validate().unwrap();
    c.low_watermark = 0.95;
    let e = c.validate().unwrap_err();
    assert!(e.to_string().starts_with("low-wm (UMBP_DRAM_LOW_WM): "), "{e}");
    assert!(e.naming_keyword().starts_with("low_wm: "), "{e}");
    c.low_watermark = 0.7;
    c.limits.inflight = 0;
    assert!(c.validate().unwrap_err().to_string().contains("max-inflight"));
    c.limits.inflight = 1;
    c.limits.arena_bytes = 1 << 30;
    assert!(c.validate().unwrap_err().to_string().contains("max-arena-bytes"));
    c.limits.arena_bytes = 64 << 20;
    c.limits.sq_entries = 3000;
    assert!(c.validate().unwrap_err().to_string().contains("max-sq-entries"));
}

#[test]
fn groups_and_acls() {
    assert_eq!(parse_group("socket-group", "1234"), Ok(1234));
    assert_eq!(parse_group("socket-group", "root"), Ok(0));
    let e = parse_group("socket-group", "no-such-group-umbp").unwrap_err();
    assert!(e.to_string().starts_with("socket-group:") && e.to_string().contains("no group"), "{e}");
    assert!(parse_group("socket-group", "").is_err());
    assert_eq!(parse_namespace_acl("namespace-acl", "1000:ff,0x10"), Ok((1000, vec![0xff, 0x10])));
    assert!(parse_namespace_acl("namespace-acl", "1000").unwrap_err().to_string().contains("UID:NSHEX"));
    assert!(parse_namespace_acl("namespace-acl", "x:1").is_err());
    assert!(parse_namespace_acl("namespace-acl", "1:").is_err());
    assert!(parse_namespace_acl("namespace-acl", "1:zz").is_err());
    assert!(parse_namespace_acl("namespace-acl", &format!("1:{}", "f".repeat(33))).is_err());
}

/// Every default of `PoolConfig` (and of the engine and SSD configs it holds) is the
/// table's: a default written anywhere else that disagrees fails here.
#[test]
fn defaults_come_from_the_settings_table() {
    use settings::*;
    let d = PoolConfig::default();
    let size = |s: &'static Setting| parse_size(s.flag, s.default_str()).unwrap();
    let fraction = |s: &'static Setting| parse_fraction(s.flag, s.default_str()).unwrap();
    let number = |s: &'static Setting| parse_number::<u64>(s.flag, s.default_str()).unwrap();
    let boolean = |s: &'static Setting| parse_bool(s.flag, s.default_str()).unwrap();
    assert_eq!((d.high_watermark, d.low_watermark), (fraction(&HIGH_WM), fraction(&LOW_WM)));
    assert_eq!((d.hugepages, d.prefault), (boolean(&HUGEPAGES), boolean(&PREFAULT)));
    assert_eq!(d.min_object_bytes, size(&MIN_OBJECT_SIZE));
    assert_eq!(d.lease, Duration::from_millis(number(&LEASE_MS)));
    assert_eq!(d.copy_threads_per_peer as u64, number(&COPY_THREADS_PER_PEER));
    assert_eq!(d.store_fence_timeout, Duration::from_millis(number(&STORE_FENCE_TIMEOUT_MS)));
    assert_eq!(d.store_fence_timeout, umbp_gpu::fence::FENCE_TIMEOUT, "the fence's own default agrees");
    assert_eq!((d.copy_stage_bytes, DEFAULT_COPY_STAGE_BYTES), (size(&COPY_STAGE_SIZE), size(&COPY_STAGE_SIZE)));
    assert_eq!(COPY_STAGE_GROWTH.default, Some("auto"));
    assert_eq!((d.copy_stage_growth_percent, DEFAULT_COPY_STAGE_GROWTH_PERCENT), (AUTO_COPY_STAGE_GROWTH, AUTO_COPY_STAGE_GROWTH));
    assert_eq!((d.promotion_ahead_bytes, DEFAULT_PROMOTION_AHEAD_BYTES), (size(&PROMOTION_AHEAD), size(&PROMOTION_AHEAD)));
    assert_eq!(IDLE_POLL_US.default, Some("auto"));
    assert_eq!((d.idle_poll, DEFAULT_IDLE_POLL), (IdlePoll::Auto { max: AUTO_IDLE_POLL_MAX }, IdlePoll::Auto { max: AUTO_IDLE_POLL_MAX }));
    assert_eq!(d.engine, umbp_gpu::EngineConfig::default(), "the GPU engine's own defaults agree with the table");
    assert_eq!(
        (d.engine.streams as u64, d.engine.batch, d.engine.batch_max as u64, d.engine.parallel_submit),
        (number(&COPY_STREAMS), boolean(&COPY_BATCH), number(&COPY_BATCH_MAX), boolean(&COPY_PARALLEL_SUBMIT))
    );
    let g = &d.engine.gather;
    assert_eq!(COPY_KERNEL.default, Some("auto"));
    assert_eq!(
        (g.mode, g.blocks as u64, g.launch_bytes as u64, g.split_streams as u64),
        (umbp_gpu::GatherMode::Auto, number(&COPY_KERNEL_BLOCKS), size(&COPY_KERNEL_LAUNCH_SIZE), number(&COPY_SPLIT_STREAMS))
    );
    assert_eq!(d.max_attachments as u64, number(&MAX_ATTACHMENTS));
    let l = &d.limits;
    assert_eq!(
        (l.attachments_per_uid as u64, l.registered_bytes, l.regions as u64, l.layouts as u64),
        (number(&MAX_ATTACHMENTS_PER_UID), size(&MAX_REGISTERED_BYTES), number(&MAX_REGIONS), number(&MAX_LAYOUTS))
    );
    assert_eq!(
        (l.inflight as u64, l.inflight_bytes, l.arena_bytes, l.sq_entries as u64),
        (number(&MAX_INFLIGHT), size(&MAX_INFLIGHT_BYTES), size(&MAX_ARENA_BYTES), number(&MAX_SQ_ENTRIES))
    );
    assert_eq!(
        (d.uid_limits.regions, d.uid_limits.registered_bytes, d.uid_limits.layouts),
        (4 * l.regions, 4 * l.registered_bytes, 4 * l.layouts),
        "per-uid defaults are four attachments' (as their help says)"
    );
    let c = &d.control;
    assert_eq!(
        (
            c.handshake_timeout.as_millis() as u64,
            c.message_timeout.as_millis() as u64,
            c.max_handshakes as u64,
            c.handshakes_per_uid as u64,
            c.fd_reserve
        ),
        (
            number(&HANDSHAKE_TIMEOUT_MS),
            number(&CONTROL_TIMEOUT_MS),
            number(&MAX_HANDSHAKES),
            number(&MAX_HANDSHAKES_PER_UID),
            number(&FD_RESERVE)
        )
    );
    assert_eq!((d.namespace_share, d.lease_share), (fraction(&NAMESPACE_SHARE), fraction(&LEASE_SHARE)));
    // The SSD tier: unset settings take the table's defaults, which the store's own agree with.
    let dir = tempfile::tempdir().unwrap();
    let s = SsdSettings { dirs: vec![dir.path().into()], capacity_bytes: Some(4 << 30), ..Default::default() }.resolve().unwrap().unwrap();
    let own = umbp_ssd::SsdConfig::default();
    assert_eq!((s.high_watermark, s.low_watermark), (fraction(&SSD_HIGH_WM), fraction(&SSD_LOW_WM)));
    assert_eq!((s.high_watermark, s.low_watermark), (own.high_watermark, own.low_watermark));
    assert_eq!((s.direct_io, own.direct_io), (boolean(&SSD_DIRECT_IO), boolean(&SSD_DIRECT_IO)));
    assert_eq!((s.admission, own.admission), (parse_admission_default(), parse_admission_default()));
    assert_eq!((s.queue_depth as u64, own.queue_depth as u64), (number(&SSD_QUEUE_DEPTH), number(&SSD_QUEUE_DEPTH)));
    let flush = parse_seconds(SSD_FLUSH_ON_STOP.flag, SSD_FLUSH_ON_STOP.default_str()).unwrap();
    assert_eq!((s.flush_on_stop, own.flush_on_stop), (flush, flush));
    let sync = parse_seconds(SSD_SYNC_INTERVAL.flag, SSD_SYNC_INTERVAL.default_str()).unwrap();
    assert_eq!((s.sync_interval, own.sync_interval), (sync, sync));
    assert_eq!((s.segment_bytes, own.segment_bytes), (ssd::MAX_DEFAULT_SEGMENT_BYTES, ssd::MAX_DEFAULT_SEGMENT_BYTES));
}

fn parse_admission_default() -> umbp_ssd::SsdAdmission {
    ssd::parse_admission("ssd-admission", settings::SSD_ADMISSION.default_str()).unwrap()
}

/// Every default in the table parses with its kind's parser: a typo there would
/// otherwise only show when a face reads it.
#[test]
fn every_table_default_parses() {
    for s in settings::ALL {
        let Some(v) = s.default else { continue };
        let ok = match s.kind {
            "SIZE" => parse_size(s.flag, v).is_ok(),
            "FRACTION" => parse_fraction(s.flag, v).is_ok(),
            "BOOL" => parse_bool(s.flag, v).is_ok(),
            "N" | "MS" => parse_number::<u64>(s.flag, v).is_ok(),
            "SECONDS" => parse_seconds(s.flag, v).is_ok(),
            "PERCENT|auto" => parse_growth(s.flag, v).is_ok(),
            "US|auto" => parse_idle_poll(s.flag, v).is_ok(),
            "MODE" => parse_copy_kernel(s.flag, v).is_ok(),
            "POLICY" => ssd::parse_admission(s.flag, v).is_ok(),
            other => panic!("{}: no parser for kind {other}", s.flag),
        };
        assert!(ok, "{}: default {v:?} does not parse as {}", s.flag, s.kind);
    }
}

/// The SSD checks live in `validate`, so every face refuses a bad directory or size
/// alike, naming the setting and the path.
#[test]
fn validate_checks_the_ssd_directories_and_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let with = |dirs: Vec<PathBuf>, capacity: u64| {
        let ssd = SsdSettings { dirs, capacity_bytes: Some(capacity), ..Default::default() }.resolve().unwrap();
        PoolConfig { capacity_bytes: 64 << 20, ssd, ..Default::default() }.validate()
    };
    with(vec![dir.path().into()], 64 << 20).unwrap();
    let missing = dir.path().join("missing");
    let e = with(vec![missing.clone()], 64 << 20).unwrap_err();
    assert!(e.to_string().starts_with("ssd-dir (UMBP_SSD_DIR): ") && e.to_string().contains(missing.to_str().unwrap()), "{e}");
    assert!(e.naming_keyword().starts_with(&format!("ssd_dir: {}: ", missing.display())), "{e}");
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    assert!(with(vec![file], 64 << 20).unwrap_err().to_string().contains("not a directory"));
    // Below one 1 MiB segment per directory.
    assert!(with(vec![dir.path().into()], 512 << 10).unwrap_err().to_string().starts_with("ssd-capacity"));
    assert_eq!(ssd::default_segment_bytes(64 << 20, 1), 16 << 20);
    assert_eq!(ssd::default_segment_bytes(8 << 30, 2), 256 << 20);
    assert_eq!(ssd::default_segment_bytes(1 << 20, 1), 1 << 20);
    // Capacity left unset: half the free space, at least one segment per directory.
    let s = SsdSettings { dirs: vec![dir.path().into()], ..Default::default() }.resolve().unwrap().unwrap();
    assert!(s.capacity_bytes >= s.segment_bytes && s.segment_bytes >= 1 << 20, "{s:?}");
    assert!(SsdSettings::default().resolve().unwrap().is_none(), "no directory: no tier");
}
