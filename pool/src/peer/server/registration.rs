//! Registrations on the control socket: a worker's memory regions (host process memory,
//! memfds, GPU IPC handles) and KV layouts, checked against the per-attachment and per-uid
//! limits before they are accepted.

use std::sync::Arc;

use umbp_protocol::layout::KvLayout;
use umbp_protocol::wire::{Reply, ReplyStatus, Role};

use crate::peer::attachment::Attachment;
use crate::peer::validate;
use crate::PoolInner;

/// What all live attachments of `uid` hold: (regions, registered bytes, layouts).
fn uid_usage(inner: &PoolInner, uid: u32) -> (usize, u64, usize) {
    let list = inner.attachments.lock().expect("attachments lock").clone();
    list.iter().filter(|a| a.uid == uid && a.is_alive()).fold((0, 0, 0), |(r, b, l), a| {
        (
            r + a.regions.read().expect("regions lock").len(),
            b.saturating_add(a.registered_bytes()),
            l + a.layouts.read().expect("layouts lock").len(),
        )
    })
}

/// The per-uid totals (`--max-regions-per-uid`, `--max-registered-bytes-per-uid`) for one
/// more region of `size` bytes.
fn check_uid_registration(inner: &PoolInner, uid: u32, size: u64) -> Result<(), validate::Refusal> {
    let l = &inner.config.uid_limits;
    let (regions, bytes, _) = uid_usage(inner, uid);
    let refuse = |message: String| Err(validate::Refusal { status: ReplyStatus::ResourceExhausted, message });
    if regions >= l.regions {
        return refuse(format!("uid {uid} already has {regions} regions registered, the limit per uid (--max-regions-per-uid)"));
    }
    if bytes.checked_add(size).is_none_or(|t| t > l.registered_bytes) {
        return refuse(format!(
            "registering {size} more bytes would exceed the {} bytes uid {uid} may register in all its attachments \
             (--max-registered-bytes-per-uid; {bytes} registered)",
            l.registered_bytes
        ));
    }
    Ok(())
}

pub(super) fn register_memory(inner: &PoolInner, att: &Attachment, payload: &[u8], fds: Vec<std::os::fd::OwnedFd>) -> Reply {
    let (reg, kind) = match validate::parse_memory_registration(payload) {
        Ok(r) => r,
        Err(r) => return Reply::error(r.status, &r.message),
    };
    if att.role != Role::Worker {
        return Reply::error(ReplyStatus::PermissionDenied, "only workers register memory");
    }
    // A registration of an alloc_id this peer registered already, with the same size, is a
    // retry (the worker gave up waiting for the reply of a pool that stalled, and sends it
    // again): the new region replaces the old one, so a timed-out registration never
    // refuses every retry (issue #31). Layouts stay valid (same size); copies running now
    // keep the region they started with (they hold its Arc). Another size is refused.
    let replaced = att.regions.read().expect("regions lock").get(&reg.alloc_id).map(|r| r.len());
    if let Some(len) = replaced {
        if len != reg.size {
            return Reply::error(
                ReplyStatus::InvalidRequest,
                &format!(
                    "alloc_id {} is already registered with {len} bytes, not {} (a retry must repeat the registration)",
                    reg.alloc_id, reg.size
                ),
            );
        }
    }
    // --max-regions / --max-registered-bytes, on the claimed size before opening anything
    // (a retry's old region does not count: it is replaced).
    let (count, bytes) =
        (att.regions.read().expect("regions lock").len() - replaced.is_some() as usize, att.registered_bytes() - replaced.unwrap_or(0));
    if let Err(r) = validate::check_registration(count, bytes, reg.size, &inner.config.limits) {
        tracing::warn!(attachment = att.id, pid = att.pid, "memory registration refused: {}", r.message);
        return Reply::error(r.status, &r.message);
    }
    // --max-regions-per-uid / --max-registered-bytes-per-uid: all attachments of the uid
    // (a retry adds nothing to them).
    if let Err(r) = if replaced.is_some() { Ok(()) } else { check_uid_registration(inner, att.uid, reg.size) } {
        tracing::warn!(attachment = att.id, pid = att.pid, "memory registration refused: {}", r.message);
        return Reply::error(r.status, &r.message);
    }
    let backend = match umbp_gpu::backend_for(kind) {
        Ok(b) => b,
        Err(e) => {
            let hint = match kind {
                umbp_protocol::wire::MemoryKind::Cuda | umbp_protocol::wire::MemoryKind::Hip => {
                    " (umbp-pool must see every GPU its workers use: check its CUDA_VISIBLE_DEVICES / container devices)"
                }
                _ => "",
            };
            return Reply::error(ReplyStatus::Unsupported, &format!("{kind:?} memory: {e}{hint}"));
        }
    };
    // The pid comes from SO_PEERCRED, never from the message, and is checked to still be
    // the process that connected, running as the peer's uid (HostProcess; item 1 of #13).
    let verify = || att.process.verify();
    let engine = inner.config.engine;
    let peer = umbp_gpu::Peer { attachment: att.id, pid: att.pid, pidfd: att.process.pidfd(), verify: &verify, engine };
    // A GPU region goes before the background DRAM registration (pinning.rs), which the
    // driver would otherwise let hold it for minutes (issue #33 item 4).
    let gpu = matches!(kind, umbp_protocol::wire::MemoryKind::Cuda | umbp_protocol::wire::MemoryKind::Hip);
    let _first = gpu.then(|| inner.store.dram.gate.enter());
    let opened = backend.open_region_for(&reg, fds.into_iter().next(), &peer);
    drop(_first);
    match opened {
        Ok(region) => {
            // The opened size is what copies may touch; check it too.
            if region.len() != replaced.unwrap_or(region.len()) {
                return Reply::error(ReplyStatus::InvalidRequest, &format!("alloc_id {}: a retry opened another size", reg.alloc_id));
            }
            if let Err(r) = validate::check_registration(count, bytes, region.len(), &inner.config.limits).and_then(|()| {
                if replaced.is_some() {
                    Ok(())
                } else {
                    check_uid_registration(inner, att.uid, region.len())
                }
            }) {
                return Reply::error(r.status, &r.message);
            }
            if replaced.is_some() {
                tracing::info!(attachment = att.id, alloc = reg.alloc_id, "memory registration repeated (a retry): the region is replaced");
            }
            tracing::info!(attachment = att.id, alloc = reg.alloc_id, ?kind, bytes = region.len(), "memory registered");
            att.regions.write().expect("regions lock").insert(reg.alloc_id, Arc::from(region));
            att.region_devices.lock().expect("devices lock").insert(reg.alloc_id, reg.device_uuid);
            Reply::ok(reg.alloc_id as u64)
        }
        Err(e) => Reply::error(ReplyStatus::InvalidRequest, &format!("alloc_id {}: {e}", reg.alloc_id)),
    }
}

pub(super) fn register_layout(inner: &PoolInner, att: &Attachment, payload: &[u8]) -> Reply {
    let (group, segments) = match validate::parse_layout(payload) {
        Ok(p) => p,
        Err(r) => return Reply::error(r.status, &r.message),
    };
    {
        let layouts = att.layouts.read().expect("layouts lock");
        if let Err(r) = validate::check_layout_count(layouts.len(), layouts.contains_key(&group), &inner.config.limits) {
            return Reply::error(r.status, &r.message);
        }
        let replaces = layouts.contains_key(&group);
        drop(layouts);
        // --max-layouts-per-uid: all attachments of the uid.
        let (_, _, of_uid) = uid_usage(inner, att.uid);
        if !replaces && of_uid >= inner.config.uid_limits.layouts {
            let m = format!("uid {} already has {of_uid} layouts, the limit per uid (--max-layouts-per-uid)", att.uid);
            return Reply::error(ReplyStatus::ResourceExhausted, &m);
        }
    }
    let layout = {
        let regions = att.regions.read().expect("regions lock");
        KvLayout::new(segments, |id| regions.get(&id).map(|r| r.len()))
    };
    match layout {
        Ok(l) => {
            let bytes = l.object_bytes();
            if let Err(r) = validate::check_layout_object(group, bytes, inner.config.min_object_bytes) {
                tracing::warn!(attachment = att.id, pid = att.pid, "{}", r.message);
                return Reply::error(r.status, &r.message);
            }
            tracing::info!(attachment = att.id, group, object_bytes = bytes, blocks = l.num_blocks(), "layout registered");
            att.layouts.write().expect("layouts lock").insert(group, Arc::new(l));
            Reply::ok(bytes)
        }
        Err(e) => Reply::error(ReplyStatus::InvalidRequest, &format!("RegisterLayout group {group}: {e}")),
    }
}
