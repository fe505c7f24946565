//! How one submission is cut into copy stages. The pool's copy thread plans stage `s + 1`
//! (reserves or pins its objects, lists its copies) while stage `s` copies, so no byte
//! moves before the first stage is planned. Stages therefore start small (a few MiB
//! instead of a whole stage: ~0.4 ms of CPU for 64 MiB of 4 KiB pages on the H200
//! machine, 5 % of a 10k-token restore) and then grow by a factor up to the configured
//! size. While stage `s + 1` is planned, the GPU has at least stage `s` left to copy; so
//! the DMA never waits for the planning when planning a byte takes less than 1/growth of
//! copying it. Constant stages (growth 1) keep it fed whenever planning is faster than
//! copying at all; doubling (growth 2) needs it twice as fast, which 4 KiB pages are not
//! on every host (docs/history/benchmarks-2026-11.md, seventh pass).

/// Stages per submission at most (each costs an event per copy stream).
pub const MAX_STAGES: usize = 64;

/// The first stage is this fraction of a full stage (at least one block).
pub const FIRST_STAGE_DIVISOR: usize = 16;

/// Growth setting meaning "by the page size" ([`auto_growth_percent`]); the default.
pub const AUTO_GROWTH: u32 = 0;

/// Bytes the DMA moves while the pool plans one page of a stage (reserves its object,
/// lists the copy, orders and describes it for the device): ~50 ns per page at ~55 GB/s on
/// the H200 machine (docs/history/benchmarks-2026-11.md, seventh pass).
pub const PLANNED_BYTES_PER_PAGE: u64 = 2750;

/// Share of the copy time of the stage before that planning the next may take: the host's
/// planning time varied by half from run to run on the H200 machine.
const PLANNING_SHARE_PERCENT: u64 = 70;

/// Stage growth (percent) for pages of `avg_page_bytes` on average: as fast as planning
/// stays within [`PLANNING_SHARE_PERCENT`] of the copy time, between 100 (equal stages) and
/// 200 (doubling): small pages need equal stages to keep the DMA fed, large ones lose more
/// to 64 stages' events than the planning they hide (docs/history/benchmarks-2026-11.md,
/// seventh pass).
pub fn auto_growth_percent(avg_page_bytes: u64) -> u32 {
    let g = PLANNING_SHARE_PERCENT.saturating_mul(avg_page_bytes) / PLANNED_BYTES_PER_PAGE;
    g.clamp(100, 200) as u32
}

/// The blocks of each stage of one submission, in order: stage `s` is
/// `range(s)`, the ranges cover `0..blocks` without gaps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageSplit {
    /// End (exclusive) of each stage's block range.
    ends: Vec<usize>,
}

impl StageSplit {
    /// Stages for `blocks` blocks of `object_bytes` each with at most `stage_bytes` of
    /// objects per stage (0: one stage), at least one block each: the first stage holds
    /// 1/[`FIRST_STAGE_DIVISOR`] of a full one and each next one `growth_percent` % of
    /// the one before (at least 100: stages never shrink; pass [`auto_growth_percent`]
    /// for [`AUTO_GROWTH`]), up to a full stage. Where that
    /// would take more than [`MAX_STAGES`] stages the blocks are split evenly into
    /// [`MAX_STAGES`] instead.
    pub fn new(blocks: usize, object_bytes: u64, stage_bytes: u64, growth_percent: u32) -> Self {
        if stage_bytes == 0 || blocks == 0 {
            return StageSplit { ends: vec![blocks] };
        }
        let full = usize::try_from(stage_bytes / object_bytes.max(1)).unwrap_or(usize::MAX).max(1);
        let growth = growth_percent.max(100) as u64;
        let mut ends = Vec::new();
        // `size` in hundredths of a block, so that slow growth still grows from 1 block.
        let (mut end, mut size) = (0usize, ((full / FIRST_STAGE_DIVISOR).max(1) as u64).saturating_mul(100));
        while end < blocks {
            let n = usize::try_from(size / 100).unwrap_or(usize::MAX).clamp(1, full);
            end = end.saturating_add(n).min(blocks);
            ends.push(end);
            size = (size.saturating_mul(growth) / 100).min((full as u64).saturating_mul(100));
        }
        if ends.len() > MAX_STAGES {
            ends = (1..=MAX_STAGES).map(|s| s * blocks / MAX_STAGES).collect();
        }
        StageSplit { ends }
    }

    /// Number of stages (at least 1).
    pub fn count(&self) -> usize {
        self.ends.len()
    }

    /// Block range of stage `s` (`s < count()`).
    pub fn range(&self, s: usize) -> std::ops::Range<usize> {
        let start = if s == 0 { 0 } else { self.ends[s - 1] };
        start..self.ends[s]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every block in exactly one stage, in order, none empty (unless there are no blocks).
    fn assert_covers(split: &StageSplit, blocks: usize) {
        let mut next = 0;
        for s in 0..split.count() {
            let r = split.range(s);
            assert_eq!(r.start, next, "stage {s} leaves a gap or overlaps");
            assert!(blocks == 0 || !r.is_empty(), "stage {s} is empty");
            next = r.end;
        }
        assert_eq!(next, blocks);
        assert!(split.count() <= MAX_STAGES);
    }

    #[test]
    fn stages_start_small_and_double_up_to_the_configured_size() {
        // The kv4k layout of issue #14: 625 blocks of 640 KiB, 64 MiB stages (102 blocks).
        let split = StageSplit::new(625, 640 << 10, 64 << 20, 200);
        assert_covers(&split, 625);
        let sizes: Vec<usize> = (0..split.count()).map(|s| split.range(s).len()).collect();
        assert_eq!(sizes, vec![6, 12, 24, 48, 96, 102, 102, 102, 102, 31]);
    }

    #[test]
    fn auto_growth_is_equal_stages_for_4k_pages_and_doubling_from_8k() {
        assert_eq!(auto_growth_percent(4096), 104);
        assert_eq!(auto_growth_percent(2048), 100);
        assert_eq!(auto_growth_percent(0), 100);
        assert_eq!(auto_growth_percent(8192), 200);
        assert_eq!(auto_growth_percent(64 << 10), 200);
        assert_eq!(auto_growth_percent(u64::MAX), 200);
    }

    #[test]
    fn slower_growth_grows_each_stage_by_at_most_its_factor() {
        // kv4k again: 6 blocks first, full stages of 102.
        let slow = StageSplit::new(625, 640 << 10, 64 << 20, 125);
        assert_covers(&slow, 625);
        let sizes: Vec<usize> = (0..slow.count()).map(|s| slow.range(s).len()).collect();
        assert_eq!(sizes[0], 6);
        assert!(sizes.iter().all(|&n| n <= 102), "{sizes:?}");
        for w in sizes.windows(2).take(sizes.len() - 2) {
            assert!(w[1] >= w[0] && w[1] * 100 <= w[0] * 125 + 100, "{sizes:?}");
        }
        assert!(sizes.len() > 10, "{sizes:?}");
        // Constant stages of 6 blocks would be 105: evenly split into the cap instead.
        let constant = StageSplit::new(625, 640 << 10, 64 << 20, 100);
        assert_covers(&constant, 625);
        assert_eq!(constant.count(), MAX_STAGES);
        assert!((0..MAX_STAGES).all(|s| (9..=10).contains(&constant.range(s).len())));
        // Fewer blocks: constant stages of the first stage's size.
        let short = StageSplit::new(60, 640 << 10, 64 << 20, 100);
        assert_eq!((0..short.count()).map(|s| short.range(s).len()).collect::<Vec<_>>(), vec![6; 10]);
        // Below 100 % is read as 100 %: stages never shrink.
        assert_eq!(StageSplit::new(60, 640 << 10, 64 << 20, 50), short);
    }

    #[test]
    fn each_stage_is_planned_while_nearly_as_many_bytes_are_queued_before_it() {
        for (blocks, object, stage) in
            [(625, 640 << 10, 64 << 20), (300, 3 << 20, 64 << 20), (7, 1 << 20, 4 << 20), (40, 1 << 20, 16 << 20)]
        {
            let split = StageSplit::new(blocks, object, stage, 200);
            let first = split.range(0).len();
            assert!(split.count() > 1, "{blocks} x {object} B in stages of {stage} B");
            let mut queued = first;
            for s in 1..split.count() {
                let n = split.range(s).len();
                assert!(n <= queued + first, "stage {s} of {n} blocks after {queued} queued");
                queued += n;
            }
        }
    }

    #[test]
    fn no_stage_size_or_tiny_objects_give_one_stage_or_at_most_the_cap() {
        assert_eq!(StageSplit::new(100, 4096, 0, 200).count(), 1);
        assert_eq!(StageSplit::new(100, 4096, 0, 200).range(0), 0..100);
        assert_eq!(StageSplit::new(0, 4096, 1 << 20, 200).count(), 1);
        assert_eq!(StageSplit::new(0, 4096, 1 << 20, 200).range(0), 0..0);
        // One block per stage: as many stages as blocks up to the cap.
        let one = StageSplit::new(5, 1 << 20, 1 << 20, 200);
        assert_eq!(one.count(), 5);
        assert_covers(&one, 5);
        let capped = StageSplit::new(1000, 1 << 20, 1 << 20, 200);
        assert_eq!(capped.count(), MAX_STAGES);
        assert_covers(&capped, 1000);
        // Objects larger than a stage: one block per stage.
        assert_eq!(StageSplit::new(3, 8 << 20, 1 << 20, 200).count(), 3);
        // Everything fits in the first stage.
        assert_eq!(StageSplit::new(4, 4096, 64 << 20, 200).count(), 1);
    }

    #[test]
    fn any_input_is_covered_without_gaps() {
        for blocks in [1, 2, 3, 17, 100, 625, 4095] {
            for object in [1u64, 4096, 640 << 10, 16 << 20] {
                for stage in [1u64, 4096, 1 << 20, 64 << 20, u64::MAX] {
                    for growth in [0, 100, 125, 200, 1000] {
                        assert_covers(&StageSplit::new(blocks, object, stage, growth), blocks);
                    }
                }
            }
        }
    }
}
