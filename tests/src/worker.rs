//! In-process workers whose KV lives in a memfd: the setup most pool tests share.

use umbp_ipc::SharedMemory;
use umbp_worker::{Segment, Worker, WorkerConfig};

/// A worker attached with `config`, its KV a memfd of `blocks` pages of `page` bytes,
/// registered with layout group 0 (one segment, page after page). The memfd is returned
/// too: the test writes and reads the KV through it.
pub fn worker_on_memfd(config: WorkerConfig, page: u64, blocks: u64) -> (Worker, SharedMemory) {
    let mut w = Worker::connect(config).expect("worker attaches");
    let kv = SharedMemory::create("kv", (page * blocks) as usize, false).unwrap();
    let alloc = w.register_memfd(kv.fd().try_clone_to_owned().unwrap(), 0, page * blocks).unwrap();
    w.register_layout(0, vec![Segment::new(alloc, 0, page, page, blocks)]).unwrap();
    (w, kv)
}
