//! Issue #31 item 6f: a `RegisterMemory` that timed out on the worker's side (the pool was
//! stalled, e.g. SIGSTOPped, during vLLM's `register_kv_caches`) is still carried out by
//! the pool when it resumes; the worker's retry of the same registration must then
//! succeed (it replaces the region), not be refused as "already registered" for ever,
//! which kept the engine from starting. A real `umbp-pool` process, stopped and resumed.

mod common;

use std::time::Duration;

use common::{start_pool, unique_socket, RawPeer};
use umbp_ipc::message::{recv_message, send_message};
use umbp_ipc::SharedMemory;
use umbp_protocol::entries::{BlockRef, BlockStatus, Opcode, Sqe};
use umbp_protocol::layout::Segment;
use umbp_protocol::wire::{LayoutHeader, MessageKind, Reply, Role};
use umbp_protocol::ObjectKey;

const PAGE: u64 = 4096;
const BLOCKS: u64 = 16;

fn reply(m: &umbp_ipc::message::Message) -> Reply {
    assert_eq!(m.kind, MessageKind::Reply);
    *bytemuck::from_bytes::<Reply>(&m.payload[..std::mem::size_of::<Reply>()])
}

#[test]
fn a_registration_retried_after_a_timeout_succeeds() {
    let pool = start_pool(&unique_socket("register-retry"), &[]);
    let mut peer = RawPeer::attach(&pool.socket, Role::Worker, 9).unwrap();
    let mem = SharedMemory::create("kv", (PAGE * BLOCKS) as usize, false).unwrap();
    let reg = umbp_gpu::host::export_memfd(mem.fd(), 0, PAGE * BLOCKS, 0).unwrap();

    // The pool stalls; the worker's registration times out.
    pool.signal(libc::SIGSTOP);
    send_message(&peer.sock, MessageKind::RegisterMemory, bytemuck::bytes_of(&reg), &[mem.fd()], Some(Duration::from_secs(5))).unwrap();
    assert!(recv_message(&peer.sock, Some(Duration::from_millis(300))).is_err(), "a stopped pool answers nothing");
    // It resumes and carries the registration out; the late answer is read (and dropped).
    pool.signal(libc::SIGCONT);
    let late = reply(&recv_message(&peer.sock, Some(Duration::from_secs(5))).unwrap());
    assert_eq!(late.status, 0, "{}", late.message());

    // The retry of the same registration succeeds.
    let (r, _) = peer.control(MessageKind::RegisterMemory, bytemuck::bytes_of(&reg), &[mem.fd()]);
    assert_eq!(r.status, 0, "a retried registration is refused: {}", r.message());
    assert_eq!(r.value, 0);
    // Another size under the same alloc_id is still refused, naming it.
    let other = umbp_gpu::host::export_memfd(mem.fd(), 0, PAGE * (BLOCKS / 2), 0).unwrap();
    let (r, _) = peer.control(MessageKind::RegisterMemory, bytemuck::bytes_of(&other), &[mem.fd()]);
    assert_ne!(r.status, 0);
    assert!(r.message().contains("alloc_id 0"), "{}", r.message());

    // The region works: a layout over it, a store and a load of one block.
    let mut msg = bytemuck::bytes_of(&LayoutHeader { group: 0, segment_count: 1 }).to_vec();
    msg.extend_from_slice(bytemuck::bytes_of(&Segment::new(0, 0, PAGE, PAGE, BLOCKS)));
    let (r, _) = peer.control(MessageKind::RegisterLayout, &msg, &[]);
    assert_eq!(r.status, 0, "{}", r.message());
    // SAFETY: inside the mapping; the pool copies only during the submissions below.
    unsafe { std::ptr::write_bytes(mem.as_ptr(), 0x6b, PAGE as usize) };
    let arena = peer.arena();
    arena.write(0, &[BlockRef::new(ObjectKey(5), 0)]).unwrap();
    let sqe = |op: Opcode| Sqe { opcode: op as u8, count: 1, refs_offset: 0, status_offset: 1024, user_data: 1, ..Sqe::default() };
    assert_eq!(peer.submit_and_reap(&[sqe(Opcode::Store)])[0].ok_count, 1);
    arena.write(0, &[BlockRef::new(ObjectKey(5), 3)]).unwrap();
    assert_eq!(peer.submit_and_reap(&[sqe(Opcode::Load)])[0].ok_count, 1);
    assert_eq!(BlockStatus::from_u8(arena.read::<u8>(1024, 1).unwrap()[0]), BlockStatus::Loaded);
    // SAFETY: inside the mapping; no submission runs now.
    let got = unsafe { std::slice::from_raw_parts(mem.as_ptr().add(3 * PAGE as usize), PAGE as usize) };
    assert!(got.iter().all(|b| *b == 0x6b), "the loaded block holds the stored bytes");
}
