//! Cutting ops into copy items and spreading them over streams in growing batches.

use super::item::Item;
use crate::CopyOp;

/// Ops larger than this are cut so that one huge op also spreads over the streams.
pub(super) const SPLIT_BYTES: u64 = 16 << 20;

/// Size of the first batch of each stream's run (then growing by BATCH_GROWTH up to the
/// batch maximum).
pub(crate) const FIRST_BATCH: usize = 16;
/// Batch growth factor, 4/3: the driver takes ~0.85 µs per copy and the DMA drains a 64 KiB
/// copy in ~1.2 µs on the H200, so a batch may be at most ~1.4x the one before for the DMA
/// not to idle while it is handed over (doubling left gaps;
/// docs/history/benchmarks-2026-11.md, "GPU transfers").
const BATCH_GROWTH_NUM: usize = 4;
const BATCH_GROWTH_DEN: usize = 3;

/// End of the registered range containing `addr`, if any.
pub(super) fn range_end(ranges: &[(usize, usize)], addr: usize) -> Option<usize> {
    let i = ranges.partition_point(|r| r.0 <= addr);
    (i > 0 && ranges[i - 1].1 > addr).then(|| ranges[i - 1].1)
}

/// Appends the items of `op` (device side at `dev_base`), cut at `split` bytes and at the
/// ends of registered host ranges.
pub(crate) fn push_items(items: &mut Vec<Item>, host_base: *mut u8, dev_base: u64, op: &CopyOp, ranges: &[(usize, usize)], split: u64) {
    let mut done = 0;
    while done < op.len {
        let host = host_base as usize + (op.host_offset + done) as usize;
        let mut piece = (op.len - done).min(split);
        if let Some(end) = range_end(ranges, host) {
            piece = piece.min((end - host) as u64);
        }
        items.push(Item { host: host as *mut u8, device: dev_base + op.device_offset + done, len: piece as usize });
        done += piece;
    }
}

/// Checks the ops of one region as [`crate::check_ops`] does and appends their items as
/// [`push_items`] does, in one pass (issue #14: a kv4k stage is 16,000 ops). The
/// registration that held the last op's host range is tried first (a stage's ops almost
/// always lie in the pool's one DRAM registration); only ops outside it, or over `split`
/// bytes, take [`push_items`]'s search. On a bad op nothing is appended and the error is
/// `check_ops`'s.
#[allow(clippy::too_many_arguments)]
pub(crate) fn push_ops(
    items: &mut Vec<Item>,
    host_base: *mut u8,
    dev_base: u64,
    ops: &[CopyOp],
    alloc_id: u32,
    region_len: u64,
    ranges: &[(usize, usize)],
    split: u64,
) -> Result<(), crate::GpuError> {
    let start = items.len();
    items.reserve(ops.len());
    // Without registrations no op is cut but at `split`: every range "fits".
    let mut cur = if ranges.is_empty() { (0, usize::MAX) } else { (0, 0) };
    for op in ops {
        if op.alloc_id != alloc_id || !crate::op_inside(op, region_len) {
            items.truncate(start);
            return crate::check_ops(ops, alloc_id, region_len);
        }
        let host = host_base as usize + op.host_offset as usize;
        let fits = op.len <= split && host >= cur.0 && host.checked_add(op.len as usize).is_some_and(|end| end <= cur.1);
        if fits {
            items.push(Item { host: host as *mut u8, device: dev_base + op.device_offset, len: op.len as usize });
            continue;
        }
        push_items(items, host_base, dev_base, op, ranges, split);
        let i = ranges.partition_point(|r| r.0 <= host);
        if let Some(&r) = i.checked_sub(1).map(|i| &ranges[i]).filter(|r| r.1 > host) {
            cur = r;
        }
    }
    Ok(())
}

/// The batch after one of `size` copies: BATCH_GROWTH larger (at least one more), at most
/// `per_call`.
pub(crate) fn next_batch(size: usize, per_call: usize) -> usize {
    (size * BATCH_GROWTH_NUM / BATCH_GROWTH_DEN).max(size + 1).min(per_call)
}

/// Splits `items` into at most `n` contiguous runs of about equal bytes.
pub(crate) fn balance(items: &[Item], n: usize) -> Vec<std::ops::Range<usize>> {
    let total: u64 = items.iter().map(|i| i.len as u64).sum();
    let n = n.clamp(1, items.len().max(1));
    let mut runs = Vec::with_capacity(n);
    let (mut start, mut acc) = (0, 0u64);
    for (i, it) in items.iter().enumerate() {
        acc += it.len as u64;
        // Close run k once it holds its share of the bytes (k+1)/n of the total.
        if acc * n as u64 >= total * (runs.len() as u64 + 1) && runs.len() + 1 < n {
            runs.push(start..i + 1);
            start = i + 1;
        }
    }
    if start < items.len() || runs.is_empty() {
        runs.push(start..items.len());
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(device_offset: u64, host_offset: u64, len: u64) -> CopyOp {
        CopyOp { alloc_id: 1, device_offset, host_offset, len }
    }

    #[test]
    fn items_are_cut_at_split_size_and_registration_ends() {
        let base = 0x1000_0000usize as *mut u8;
        let mut items = Vec::new();
        // 40 MiB op, no registrations: 16 + 16 + 8.
        push_items(&mut items, base, 0x9000, &op(0, 0, 40 << 20), &[], SPLIT_BYTES);
        assert_eq!(items.iter().map(|i| i.len).collect::<Vec<_>>(), vec![16 << 20, 16 << 20, 8 << 20]);
        assert_eq!(items[1].device, 0x9000 + (16 << 20));
        assert_eq!(items[1].host as usize, 0x1000_0000 + (16 << 20));
        // A registration boundary 1 MiB into the op cuts it there.
        items.clear();
        let ranges = [(0x1000_0000, 0x1000_0000 + (1 << 20)), (0x1000_0000 + (1 << 20), 0x2000_0000)];
        push_items(&mut items, base, 0, &op(0, 4096, 2 << 20), &ranges, SPLIT_BYTES);
        assert_eq!(items.len(), 2);
        assert_eq!(items[0].len, (1 << 20) - 4096);
        assert_eq!(items[0].len + items[1].len, 2 << 20);
        assert_eq!(items[1].host as usize, 0x1000_0000 + (1 << 20));
        assert_eq!(range_end(&ranges, 0x0fff_ffff), None);
        assert_eq!(range_end(&ranges, 0x2000_0000), None);
    }

    /// `push_ops` (one pass, last registration tried first) appends exactly what
    /// `check_ops` + `push_items` per op did, whatever the mix of ops inside one
    /// registration, across two, outside all, over the split size, or with no
    /// registrations at all; a bad op appends nothing and gives `check_ops`'s error.
    #[test]
    fn push_ops_is_check_ops_and_push_items_in_one_pass() {
        let base = 0x1000_0000usize as *mut u8;
        let ranges = [(0x1000_0000, 0x1010_0000), (0x1010_0000, 0x1400_0000), (0x1800_0000, 0x1900_0000)];
        let ops = [
            op(0, 0, 4096),
            op(4096, 8192, 4096),
            op(0, 0x10_0000 - 2048, 4096), // straddles the first two registrations
            op(0x2000, 0x20_0000, 4096),   // in the second
            op(0x3000, 0x20_1000, 4096),
            op(0x4000, 0x500_0000, 4096),     // in none
            op(0x5000, 0x800_0000, 4096),     // the third
            op(0x6000, 0x100_0000, 40 << 20), // over the split size and into no registration
            op(0x7000, 16, 48),
        ];
        for ranges in [&ranges[..], &[]] {
            let mut want = vec![Item { host: std::ptr::null_mut(), device: 1, len: 1 }];
            for o in &ops {
                push_items(&mut want, base, 0x9_0000_0000, o, ranges, SPLIT_BYTES);
            }
            let mut got = vec![Item { host: std::ptr::null_mut(), device: 1, len: 1 }];
            push_ops(&mut got, base, 0x9_0000_0000, &ops, 1, 1 << 40, ranges, SPLIT_BYTES).unwrap();
            assert_eq!(got, want, "ranges {ranges:?}");
        }
        let mut items = vec![];
        let mut bad = ops.to_vec();
        bad[3].alloc_id = 2;
        let e = push_ops(&mut items, base, 0, &bad, 1, 1 << 40, &ranges, SPLIT_BYTES).unwrap_err();
        assert_eq!(e.to_string(), crate::check_ops(&bad, 1, 1 << 40).unwrap_err().to_string());
        assert!(items.is_empty(), "a refused region appends nothing");
        let e = push_ops(&mut items, base, 0, &ops, 1, 0x6000, &ranges, SPLIT_BYTES).unwrap_err();
        assert_eq!(e.to_string(), crate::check_ops(&ops, 1, 0x6000).unwrap_err().to_string());
        assert!(items.is_empty());
    }

    #[test]
    fn batches_grow_to_the_maximum_and_stay_there() {
        for per_call in [1, 2, 16, 512, 65536] {
            let mut size = FIRST_BATCH.min(per_call);
            let mut steps = 0;
            while size < per_call {
                let next = next_batch(size, per_call);
                assert!(next > size && next <= per_call && next * 3 <= size * 4 + 3, "{size} -> {next}");
                size = next;
                steps += 1;
            }
            assert_eq!(next_batch(size, per_call), per_call, "stays at the maximum");
            assert!(steps < 40);
        }
    }

    #[test]
    fn runs_are_contiguous_and_balanced() {
        let it = |len| Item { host: std::ptr::null_mut(), device: 0, len };
        let items: Vec<Item> = (0..10).map(|_| it(64 << 10)).collect();
        let runs = balance(&items, 4);
        assert_eq!(runs.len(), 4);
        assert_eq!(runs.first().unwrap().start, 0);
        assert_eq!(runs.last().unwrap().end, 10);
        for w in runs.windows(2) {
            assert_eq!(w[0].end, w[1].start);
        }
        assert!(runs.iter().all(|r| (2..=3).contains(&r.len())), "{runs:?}");
        // Fewer items than streams: one run each.
        assert_eq!(balance(&items[..2], 4).len(), 2);
        assert_eq!(balance(&[], 4), vec![0..0]);
        // One huge item and many small ones: the huge one gets its own run.
        let mut mixed = vec![it(64 << 20)];
        mixed.extend((0..64).map(|_| it(1 << 20)));
        let runs = balance(&mixed, 2);
        assert_eq!(runs[0], 0..1);
        assert_eq!(runs[1], 1..65);
    }
}
