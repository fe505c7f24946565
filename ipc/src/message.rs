//! Framed messages on a unix stream socket: a `MessageHeader`, a payload, and fds as
//! SCM_RIGHTS on the first byte. Reads and writes take a deadline so a silent or slow peer
//! costs a bounded wait, never a hung thread.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use umbp_protocol::wire::{MessageHeader, MessageKind};
use umbp_protocol::ProtocolError;

#[derive(Debug, thiserror::Error)]
pub enum MessageError {
    #[error("peer closed the connection")]
    Closed,
    #[error("timed out waiting for the peer")]
    Timeout,
    #[error("socket error: {0}")]
    Io(#[from] std::io::Error),
    #[error("malformed message: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("peer sent {got} fds with a message that carries {want}")]
    FdCount { got: usize, want: usize },
}

/// One received message.
pub struct Message {
    pub kind: MessageKind,
    pub payload: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

const MAX_FDS: usize = 8;

fn set_timeout(sock: &UnixStream, timeout: Option<Duration>) -> std::io::Result<()> {
    sock.set_read_timeout(timeout)?;
    sock.set_write_timeout(timeout)
}

fn map_io(e: std::io::Error) -> MessageError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => MessageError::Timeout,
        std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof => {
            MessageError::Closed
        }
        _ => MessageError::Io(e),
    }
}

/// Sends `kind` with `payload` and `fds`.
pub fn send_message(
    sock: &UnixStream,
    kind: MessageKind,
    payload: &[u8],
    fds: &[BorrowedFd<'_>],
    timeout: Option<Duration>,
) -> Result<(), MessageError> {
    set_timeout(sock, timeout)?;
    let header = MessageHeader::new(kind, payload.len(), fds.len());
    let mut buf = Vec::with_capacity(16 + payload.len());
    buf.extend_from_slice(bytemuck::bytes_of(&header));
    buf.extend_from_slice(payload);
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        assert!(fds.len() <= MAX_FDS, "at most {MAX_FDS} fds per message");
        control.push(SendAncillaryMessage::ScmRights(fds));
    }
    let mut sent = sendmsg(sock.as_fd(), &[IoSlice::new(&buf)], &mut control, SendFlags::NOSIGNAL)
        .map_err(|e| map_io(e.into()))?;
    while sent < buf.len() {
        let n = sendmsg(sock.as_fd(), &[IoSlice::new(&buf[sent..])], &mut SendAncillaryBuffer::default(), SendFlags::NOSIGNAL)
            .map_err(|e| map_io(e.into()))?;
        sent += n;
    }
    Ok(())
}

/// Receives one message. `timeout` bounds each read; None blocks.
pub fn recv_message(sock: &UnixStream, timeout: Option<Duration>) -> Result<Message, MessageError> {
    set_timeout(sock, timeout)?;
    let mut head = [0u8; 16];
    let mut fds = Vec::new();
    let mut got = 0;
    while got < head.len() {
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let r = recvmsg(sock.as_fd(), &mut [IoSliceMut::new(&mut head[got..])], &mut control, RecvFlags::CMSG_CLOEXEC)
            .map_err(|e| map_io(e.into()))?;
        for msg in control.drain() {
            if let RecvAncillaryMessage::ScmRights(rights) = msg {
                fds.extend(rights);
            }
        }
        if r.bytes == 0 {
            return Err(MessageError::Closed);
        }
        got += r.bytes;
    }
    let header: MessageHeader = bytemuck::pod_read_unaligned(&head);
    let kind = header.validate()?;
    if fds.len() != header.fd_count as usize {
        return Err(MessageError::FdCount { got: fds.len(), want: header.fd_count as usize });
    }
    let mut payload = vec![0u8; header.len as usize];
    let mut off = 0;
    while off < payload.len() {
        let n = rustix::io::read(sock.as_fd(), &mut payload[off..]).map_err(|e| map_io(e.into()))?;
        if n == 0 {
            return Err(MessageError::Closed);
        }
        off += n;
    }
    Ok(Message { kind, payload, fds })
}

/// True when the peer has hung up (EOF or error pending), without consuming data.
pub fn peer_gone(sock: &UnixStream) -> bool {
    use rustix::event::{poll, PollFd, PollFlags};
    let mut fds = [PollFd::new(sock, PollFlags::IN)];
    match poll(&mut fds, Some(&rustix::time::Timespec { tv_sec: 0, tv_nsec: 0 })) {
        Ok(0) => false,
        Ok(_) => {
            let rev = fds[0].revents();
            if rev.intersects(PollFlags::HUP | PollFlags::ERR | PollFlags::NVAL) {
                return true;
            }
            // Readable: EOF reads as zero bytes; real data (a control message) means alive.
            let mut b = [0u8; 1];
            matches!(rustix::net::recv(sock, &mut b, rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT), Ok((0, _)))
        }
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use umbp_protocol::wire::{Hello, Role};

    #[test]
    fn round_trip_with_fds() {
        let (a, b) = UnixStream::pair().unwrap();
        let shm = crate::SharedMemory::create("t", 4096, false).unwrap();
        // SAFETY: inside the mapping.
        unsafe { shm.as_ptr().write(99) };
        let hello = Hello::new(Role::Worker, 5, 6);
        send_message(&a, MessageKind::Hello, bytemuck::bytes_of(&hello), &[shm.fd()], None).unwrap();
        let m = recv_message(&b, Some(Duration::from_secs(1))).unwrap();
        assert_eq!(m.kind, MessageKind::Hello);
        assert_eq!(umbp_protocol::wire::decode::<Hello>(&m.payload).unwrap(), hello);
        assert_eq!(m.fds.len(), 1);
        let mapped = crate::SharedMemory::from_received(m.fds.into_iter().next().unwrap(), 4096, false).unwrap();
        // SAFETY: inside the mapping.
        assert_eq!(unsafe { mapped.as_ptr().read() }, 99);
        assert!(!peer_gone(&b));
        drop(a);
        assert!(peer_gone(&b));
        assert!(matches!(recv_message(&b, Some(Duration::from_millis(100))), Err(MessageError::Closed)));
    }

    #[test]
    fn garbage_and_silence_are_errors() {
        let (a, b) = UnixStream::pair().unwrap();
        assert!(matches!(recv_message(&b, Some(Duration::from_millis(50))), Err(MessageError::Timeout)));
        use std::io::Write;
        (&a).write_all(&[0xAB; 16]).unwrap();
        assert!(matches!(recv_message(&b, Some(Duration::from_millis(50))), Err(MessageError::Protocol(_))));
    }
}
