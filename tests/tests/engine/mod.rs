//! A host-memory "engine" for the integration tests: a real `umbp_worker::Worker` over
//! 8 layers x 64 blocks x 64 KiB of this process's memory, filled and checked with each
//! key's pattern.
#![allow(dead_code)]

use std::time::Duration;

use umbp_integration_tests::fill_pattern;
use umbp_protocol::ObjectKey;
use umbp_worker::{BlockStatus, MemorySpec, Segment, Worker, WorkerConfig, WorkerError};

pub const PAGE: u64 = 64 << 10;
pub const LAYERS: u64 = 8;
pub const BLOCKS: u64 = 64;

/// A worker over 8 layers x 64 blocks x 64 KiB of this process's memory (32 MiB).
pub struct Engine {
    pub w: Worker,
    pub mem: Vec<u8>,
}

impl Engine {
    pub fn connect(socket: &std::path::Path, timeout: Duration) -> Engine {
        let mut cfg = WorkerConfig::new(socket, 7);
        cfg.timeout = timeout;
        let mut w = Worker::connect(cfg).expect("connect");
        let mem = vec![0x11u8; (LAYERS * BLOCKS * PAGE) as usize];
        // SAFETY: `mem` moves into the `Engine` with `w` and drops after it (field order);
        // the tests read and fill it only between transfers.
        unsafe { w.register_memory(MemorySpec::HostProcess { ptr: mem.as_ptr() as usize, len: mem.len() }) }.unwrap();
        let segs = (0..LAYERS).map(|l| Segment::new(0, l * BLOCKS * PAGE, PAGE, PAGE, BLOCKS)).collect();
        w.register_layout(0, segs).unwrap();
        Engine { w, mem }
    }

    pub fn fill(&mut self, block: u64, key: ObjectKey) {
        let mut obj = vec![0u8; (LAYERS * PAGE) as usize];
        fill_pattern(key.0, &mut obj);
        for l in 0..LAYERS {
            let off = (l * BLOCKS * PAGE + block * PAGE) as usize;
            self.mem[off..off + PAGE as usize].copy_from_slice(&obj[(l * PAGE) as usize..((l + 1) * PAGE) as usize]);
        }
    }

    pub fn verify(&self, block: u64, key: ObjectKey) -> bool {
        let mut obj = vec![0u8; (LAYERS * PAGE) as usize];
        fill_pattern(key.0, &mut obj);
        (0..LAYERS).all(|l| {
            let off = (l * BLOCKS * PAGE + block * PAGE) as usize;
            self.mem[off..off + PAGE as usize] == obj[(l * PAGE) as usize..((l + 1) * PAGE) as usize]
        })
    }

    pub fn batch(first: u128, n: u64) -> Vec<(ObjectKey, u64)> {
        (0..n).map(|i| (ObjectKey(first + i as u128), i)).collect()
    }

    pub fn store(&mut self, first: u128, n: u64) -> Result<umbp_worker::TransferId, WorkerError> {
        let b = Self::batch(first, n);
        for &(k, i) in &b {
            self.fill(i, k);
        }
        self.w.store(0, &b)
    }

    pub fn store_wait(&mut self, first: u128, n: u64) -> Vec<BlockStatus> {
        let id = self.store(first, n).expect("submit store");
        self.w.wait(id, Duration::from_secs(10)).expect("store completes").statuses
    }

    pub fn load_wait(&mut self, first: u128, n: u64) -> Vec<BlockStatus> {
        self.mem.fill(0);
        let id = self.w.load(0, &Self::batch(first, n)).expect("submit load");
        let st = self.w.wait(id, Duration::from_secs(10)).expect("load completes").statuses;
        for (i, s) in st.iter().enumerate() {
            if *s == BlockStatus::Loaded {
                assert!(self.verify(i as u64, ObjectKey(first + i as u128)), "block {i} loaded wrong bytes");
            }
        }
        st
    }
}

/// Worker attachments in a report (the report's own observer attachment is not one).
pub fn workers(report: &umbp_pool::PoolReport) -> usize {
    report.attachments_of(umbp_pool::pool_report::PeerRole::Worker).count()
}

pub fn keys(first: u128, n: u64) -> Vec<ObjectKey> {
    (0..n).map(|i| ObjectKey(first + i as u128)).collect()
}

pub fn all(st: &[BlockStatus], s: BlockStatus) -> bool {
    st.iter().all(|x| *x == s)
}
