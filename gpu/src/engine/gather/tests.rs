use super::staged::{average_host_run, by_page};
use super::*;

fn it(host: usize, device: u64, len: usize) -> Item {
    Item { host: host as *mut u8, device, len }
}

#[test]
fn crossover_is_the_largest_page_where_the_kernel_wins() {
    let p = |page, d2h_ce, d2h_k, h2d_ce, h2d_k| Point {
        page,
        d2h_ce_gbps: d2h_ce,
        d2h_kernel_gbps: d2h_k,
        h2d_ce_gbps: h2d_ce,
        h2d_kernel_gbps: h2d_k,
        ..Point::default()
    };
    let c = Calibration::from_points(
        vec![p(4096, 5.0, 45.0, 5.0, 40.0), p(16384, 20.0, 48.0, 20.0, 30.0), p(65536, 50.0, 49.0, 50.0, 30.0)],
        8,
    );
    assert_eq!((c.d2h_crossover, c.h2d_crossover), (16384, 16384));
    assert!(c.use_kernel(Dir::DeviceToHost, 4096));
    assert!(c.use_kernel(Dir::DeviceToHost, 16384));
    assert!(!c.use_kernel(Dir::DeviceToHost, 16385));
    assert!(!c.use_kernel(Dir::HostToDevice, 65536));
    assert!(!c.use_kernel(Dir::HostToDevice, 0));
    // A kernel only 1% faster is not worth the SMs.
    let c = Calibration::from_points(vec![p(4096, 40.0, 40.4, 40.0, 39.0)], 8);
    assert_eq!((c.d2h_crossover, c.h2d_crossover), (0, 0));
    assert!(!c.use_kernel(Dir::DeviceToHost, 4096));
    assert_eq!(Calibration::from_points(vec![], 8).d2h_crossover, 0);
    // A kernel 5% faster than copy engines does not pay for the turns it takes.
    let c = Calibration::from_points(vec![p(65536, 50.0, 52.5, 50.0, 52.5)], 8);
    assert!(!c.use_kernel(Dir::DeviceToHost, 65536) && !c.stages_any());
}

#[test]
fn staging_is_chosen_where_it_beats_both_other_paths() {
    let p = |page, ce: f64, k: f64, d2h_st: f64, h2d_st: f64| Point {
        page,
        d2h_ce_gbps: ce,
        d2h_kernel_gbps: k,
        h2d_ce_gbps: ce,
        h2d_kernel_gbps: k,
        d2h_staged_gbps: d2h_st,
        h2d_staged_gbps: h2d_st,
    };
    let c = Calibration::from_points(
        vec![
            p(4096, 5.0, 47.0, 52.0, 47.5),   // stores stage; loads: staging not 2% over the kernel
            p(16384, 20.0, 50.0, 53.0, 53.0), // both stage
            p(65536, 51.0, 50.0, 53.0, 53.0), // staging only 4% over copy engines: not worth a kernel
        ],
        8,
    );
    assert_eq!((c.d2h_staged_up_to, c.h2d_staged_up_to), (16384, 16384));
    assert!(c.use_staged(Dir::DeviceToHost, 4096) && c.use_staged(Dir::DeviceToHost, 16384));
    assert!(!c.use_staged(Dir::DeviceToHost, 16385) && !c.use_staged(Dir::DeviceToHost, 0));
    assert!(c.stages_any());
    // Where staging is not taken (short host runs) the kernel still is.
    assert_eq!((c.d2h_crossover, c.h2d_crossover), (16384, 16384));
    // Not measured (no staging memory): never chosen.
    let c = Calibration::from_points(vec![p(4096, 5.0, 47.0, 0.0, 0.0)], 8);
    assert!(!c.stages_any() && c.use_kernel(Dir::HostToDevice, 4096));
}

#[test]
fn staging_takes_sorted_contiguous_host_runs_only() {
    // Two objects of 16 pages, handed layer by layer: host runs of 64 KiB once sorted.
    let mut items = Vec::new();
    for l in 0..16 {
        for o in 0..2 {
            items.push(it(0x100000 + o * 0x20000 + l * 4096, 0x900000 + ((l * 2 + o) * 4096) as u64, 4096));
        }
    }
    let as_handed: Vec<u32> = (0..items.len() as u32).collect();
    assert_eq!(average_host_run(&items, &as_handed), 4096, "as handed: no page follows its neighbour");
    let order = staged_order(true, &items, 1 << 20).expect("staged");
    let sorted: Vec<Item> = order.iter().map(|&i| items[i as usize]).collect();
    assert!(sorted.windows(2).all(|w| w[0].host < w[1].host));
    assert_eq!(average_host_run(&items, &order), 64 << 10);
    assert_eq!(order.len(), items.len());
    assert!(staged_order(false, &items, 1 << 20).is_none(), "only when wanted");
    assert!(staged_order(true, &items, 0).is_none(), "no staging memory");
    assert!(staged_order(true, &items[..16], 1 << 20).is_none(), "half the layers: 32 KiB runs");
    let mut odd = items.clone();
    odd[3].device += 8;
    assert!(staged_order(true, &odd, 1 << 20).is_none(), "unaligned device address");
    assert!(staged_order(true, &[it(0, 0, 2 << 20)], 1 << 20).is_none(), "copy larger than a chunk");
    assert_eq!(average_host_run(&[], &[]), 0);
    // The O(n) placement agrees with a sort, and steps aside where it cannot place.
    let span = |items: &[Item]| {
        let lo = items.iter().map(|i| i.host as usize).min().unwrap();
        let hi = items.iter().map(|i| i.host as usize + i.len).max().unwrap();
        let bits = items.iter().fold(0, |b, i| b | i.host as usize | i.len);
        (lo, hi, bits)
    };
    let place = |items: &[Item]| {
        let (lo, hi, bits) = span(items);
        by_page(items, lo, hi, bits)
    };
    let mut want: Vec<u32> = (0..items.len() as u32).collect();
    want.sort_unstable_by_key(|&i| items[i as usize].host as usize);
    assert_eq!(place(&items), Some(want));
    let mut dup = items.clone();
    dup.push(items[0]);
    assert_eq!(place(&dup), None, "two items start on one page");
    assert_eq!(place(&[it(0x1000, 0, 4096), it(0x10_0000, 0, 4096)]), None, "sparse");
    assert_eq!(place(&[it(0x1010, 0, 4096)]), None, "unaligned");
    // Where the placement steps aside the sort gives the same order: 2 KiB pages
    // (not 4 KiB multiples), two objects of 32 pages, layer by layer.
    let mut small = Vec::new();
    for l in 0..32 {
        for o in 0..2 {
            small.push(it(0x100000 + o * 0x10000 + l * 2048, 0x900000 + ((l * 2 + o) * 2048) as u64, 2048));
        }
    }
    let order = staged_order(true, &small, 1 << 20).expect("staged after a sort");
    assert!(order.windows(2).all(|w| small[w[0] as usize].host < small[w[1] as usize].host));
}

#[test]
fn launches_are_cut_by_bytes() {
    let items: Vec<Item> = (0..10).map(|k| it(k * 4096, 0, 4096)).collect();
    assert_eq!(launch_chunks(&items, 4 * 4096), vec![0..4, 4..8, 8..10]);
    assert_eq!(launch_chunks(&items, 1 << 30), vec![0..10]);
    assert_eq!(launch_chunks(&items, 100), (0..10).map(|k| k..k + 1).collect::<Vec<_>>());
    assert!(launch_chunks(&[], 4096).is_empty());
}

#[test]
fn fewest_blocks_within_three_percent() {
    assert_eq!(pick_blocks(&[(4, 20.0), (8, 40.0), (16, 49.0), (32, 50.0), (64, 50.5)]), 16);
    assert_eq!(pick_blocks(&[(4, 47.0), (8, 48.0), (16, 49.0), (32, 50.0), (64, 50.5)]), 16);
    assert_eq!(pick_blocks(&[(4, 50.0), (8, 40.0)]), 4);
    assert_eq!(pick_blocks(&[]), 16);
    // Never more blocks than one warp per page needs.
    assert_eq!(blocks_for(64, 10), 1);
    assert_eq!(blocks_for(64, 16 * 3 + 1), 4);
    assert_eq!(blocks_for(8, 100_000), 8);
}

#[test]
fn eligibility_needs_alignment_and_registered_host_memory() {
    let ranges = [(0x10000, 0x20000), (0x20000, 0x30000)];
    assert!(eligible(&[it(0x10000, 0x900000, 4096), it(0x2f000, 0x900010, 4096)], &ranges));
    assert!(!eligible(&[], &ranges));
    // Straddles two registrations (each its own mapping).
    assert!(!eligible(&[it(0x1f800, 0x900000, 4096)], &ranges));
    // Outside any registration.
    assert!(!eligible(&[it(0x30000, 0x900000, 4096)], &ranges));
    assert!(!eligible(&[it(0x0, 0x900000, 16)], &ranges));
    // Unaligned host, device or length.
    assert!(!eligible(&[it(0x10008, 0x900000, 4096)], &ranges));
    assert!(!eligible(&[it(0x10000, 0x900008, 4096)], &ranges));
    assert!(!eligible(&[it(0x10000, 0x900000, 4097)], &ranges));
}

/// The one pass of a stage finds what the separate passes did: bytes, average,
/// descriptor count, eligibility (also when items jump between registrations).
#[test]
fn scan_is_the_separate_passes_in_one() {
    let ranges = [(0x10000, 0x20000), (0x20000, 0x30000), (0x100000, 0x200000)];
    let items = [it(0x10000, 0x900000, 4096), it(0x2f000, 0x900010, 4096), it(0x100000, 0x990000, 3 * DESC_MAX), it(0x11000, 0x900000, 16)];
    let sc = scan(&items, &ranges);
    assert_eq!(sc, Scan { items: 4, bytes: 4096 * 2 + 3 * DESC_MAX as u64 + 16, descs: desc_count(&items), eligible: true });
    assert_eq!(sc.descs, 6);
    assert_eq!(sc.average(), average(&items));
    assert!(!scan(&items, &ranges[..2]).eligible, "the large item lies in no registration");
    assert_eq!(scan(&[], &ranges), Scan::default());
    assert!(!scan(&[it(0x10000, 0x900000, 4096), it(0x1f800, 0x900000, 4096)], &ranges).eligible, "straddles");
}

#[test]
fn descriptors_point_from_source_to_destination() {
    let items = [it(0x10000, 0x900000, 4096), it(0x11000, 0x980000, 8192)];
    let mut out = [Desc { src: 0, dst: 0, len: 0 }; 2];
    build_descs(Dir::DeviceToHost, &items, &mut out);
    assert_eq!(out[0], Desc { src: 0x900000, dst: 0x10000, len: 4096 });
    assert_eq!(out[1], Desc { src: 0x980000, dst: 0x11000, len: 8192 });
    build_descs(Dir::HostToDevice, &items, &mut out);
    assert_eq!(out[1], Desc { src: 0x11000, dst: 0x980000, len: 8192 });
    // A copy over DESC_MAX is cut for several warps; the pieces add up.
    let big = [it(0x100000, 0x9000000, 2 * DESC_MAX + 4096)];
    assert_eq!(desc_count(&big), 3);
    let mut out = [Desc { src: 0, dst: 0, len: 0 }; 3];
    build_descs(Dir::DeviceToHost, &big, &mut out);
    assert_eq!(out[1], Desc { src: 0x9000000 + DESC_MAX as u64, dst: 0x100000 + DESC_MAX as u64, len: DESC_MAX as u64 });
    assert_eq!(out[2].len, 4096);
}

#[test]
fn one_large_object_is_split_for_several_streams() {
    let split = GatherConfig { split_streams: 4, ..GatherConfig::default() };
    let mut items = vec![it(0x1000_0000, 0x9000_0000, 16 << 20)];
    assert!(is_large(&split, &items));
    split_large(&mut items, 4);
    assert_eq!(items.len(), 4);
    assert!(items.iter().all(|i| i.len == 4 << 20));
    for (k, i) in items.iter().enumerate() {
        assert_eq!(i.host as usize, 0x1000_0000 + k * (4 << 20));
        assert_eq!(i.device, 0x9000_0000 + (k * (4 << 20)) as u64);
    }
    // An odd size: pieces are 4 KiB multiples, the last takes the rest, bytes add up.
    let mut items = vec![it(0, 0, (1 << 20) + 4096 * 3 + 16)];
    split_large(&mut items, 4);
    assert_eq!(items.iter().map(|i| i.len).sum::<usize>(), (1 << 20) + 4096 * 3 + 16);
    assert!(items.len() == 4 && items[..3].iter().all(|i| i.len % 4096 == 0 && i.len >= LARGE_MIN_PIECE));
    // Many items already, or too small: unchanged.
    let mut many: Vec<Item> = (0..8).map(|k| it(k << 20, 0, 1 << 20)).collect();
    split_large(&mut many, 4);
    assert_eq!(many.len(), 8);
    let mut small = vec![it(0, 0, 300 << 10)];
    split_large(&mut small, 4);
    assert_eq!(small.len(), 1);
    assert!(!is_large(&split, &[it(0, 0, 64 << 10)]));
    assert!(!is_large(&split, &[it(0, 0, 1 << 20)]), "1 MiB objects are not split");
    assert!(is_large(&split, &[it(0, 0, 4 << 20)]));
    assert!(!is_large(&GatherConfig { split_streams: 1, ..split }, &[it(0, 0, 4 << 20)]), "split off");
    assert!(!is_large(&GatherConfig::default(), &[it(0, 0, 4 << 20)]), "no split by default");
}
