//! One worker connection: bounded input and output buffers, `SCM_RIGHTS` fds matched to
//! the frame whose first byte they arrived with, and the peer's credentials.

use super::closer::PeerFd;
use crate::protocol::{
    FrameError, LENGTH_PREFIX_BYTES, ProtocolError, encode_reply_into, parse_header,
};
use rmpv::Value;
use rustix::fd::{AsFd, OwnedFd};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use std::collections::VecDeque;
use std::io::{self, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;

/// The most fds one `sendmsg` can carry (the kernel's `SCM_MAX_FD`): each `recvmsg` has
/// room for all of them, because the kernel closes the fds a read has no room for on
/// the reading thread, and a peer chooses how long that close takes (row 56).
const RECV_FDS: usize = 253;
/// fds a connection may hold before the event loop weighs them against its bounds
/// (fewer need no judging).
pub const JUDGED_AFTER_FDS: usize = 32;
/// `SO_PASSRIGHTS` (Linux 6.16, the generic socket-option numbers): off, the kernel
/// refuses `SCM_RIGHTS` sent to the socket (the sender's `sendmsg` fails with `EPERM`).
const SO_PASSRIGHTS: libc::c_int = 83;
/// Bytes read per system call.
const READ_CHUNK_BYTES: usize = 64 * 1024;
/// fds one connection may hold that no complete frame has taken yet: the most one frame
/// may carry (a registration's buffers and a pidfd). Past it the connection is closed
/// and its fds with it: one fd sent over and over inside a frame that never completes
/// would otherwise fill the server's fd table (row 43).
pub const MAX_HELD_FDS: usize = kvwarden_core::node::MAX_BUFFERS_PER_REGISTRATION + 1;
/// Replies carrying fds queued at once: each holds a duplicated fd until it is sent,
/// so a peer that asks for many and reads none is cut off long before the server runs
/// out of descriptors.
const MAX_QUEUED_FD_REPLIES: usize = 2;

/// The transport of a connection.
#[derive(Debug)]
pub enum PeerSocket {
    /// Unix socket: carries fds, proves the peer.
    Unix(mio::net::UnixStream),
    /// TCP: neither.
    Tcp(mio::net::TcpStream),
}

impl PeerSocket {
    /// The mio source.
    pub fn source(&mut self) -> &mut dyn mio::event::Source {
        match self {
            PeerSocket::Unix(stream) => stream,
            PeerSocket::Tcp(stream) => stream,
        }
    }
}

/// Who is at the other end, as the kernel says (Unix socket only).
#[derive(Debug, Default)]
pub struct Credentials {
    /// The peer's uid; None over TCP.
    pub uid: Option<u32>,
    /// The peer's pid, when visible in this PID namespace.
    pub pid: Option<i32>,
    /// A pidfd of the peer process: opened by pid at accept time, or the one the peer
    /// sent of itself in `hello` (which then replaces it).
    pub pidfd: Option<OwnedFd>,
    /// Whether `pidfd` is the one the peer sent.
    pub pidfd_from_peer: bool,
    /// The process `pidfd` names.
    pub process: Option<super::peer::Process>,
    /// Its key for the node, once held in the shell's process table.
    pub key: Option<kvwarden_core::node::ProcessKey>,
}

impl Credentials {
    /// How the death of what this connection registers will be noticed.
    pub fn death_notice(&self) -> super::peer::DeathNotice {
        use super::peer::DeathNotice;
        match (&self.pidfd, self.process) {
            (Some(_), Some(_)) if self.pidfd_from_peer => DeathNotice::PidfdFromPeer,
            (Some(_), Some(_)) => DeathNotice::PidfdByPid,
            _ => DeathNotice::TimeoutOnly,
        }
    }
}

/// A complete frame, made into what the caller asked of its body, and the fds that
/// came with it.
#[derive(Debug)]
pub struct Frame<T> {
    /// What the caller made of the MessagePack body (read in place, never copied).
    pub body: T,
    /// fds that arrived with the frame's bytes, in arrival order (no allocation for a
    /// frame without any).
    pub fds: Vec<PeerFd>,
}

/// How a Unix connection is read (see [`Connection::promise_no_fds`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum FdReads {
    /// With `recvmsg`, taking the fds that come.
    Recvmsg,
    /// The kernel refuses fds from now on (`SO_PASSRIGHTS` off); what it queued before
    /// is read with `recvmsg` until a read finds the queue empty.
    Draining,
    /// With plain `read`: no fd can be queued any more.
    Plain,
}

/// What a read found.
#[derive(Debug, PartialEq, Eq)]
pub enum SocketRead {
    /// Bytes arrived; there may be more.
    Data,
    /// Bytes arrived and the socket's queue was empty after them (a short read that
    /// carried no ancillary data): new bytes will raise a new readiness event, so the
    /// extra read that would only see `EAGAIN` can be skipped. A read that carried fds
    /// is never taken as this: the kernel ends such a read early, with more queued.
    Drained,
    /// Read everything available for now.
    WouldBlock,
    /// The input buffer is full: process frames, then read again.
    Full,
    /// The peer closed its side.
    Closed,
}

/// A connection.
#[derive(Debug)]
pub struct Connection {
    /// The socket.
    pub stream: PeerSocket,
    /// The peer.
    pub peer: Credentials,
    input: Vec<u8>,
    /// Stream offset of `input[0]`.
    input_offset: u64,
    /// Bytes at the front of `input` already handed out as frames. They are dropped at
    /// the next read, so a burst of small frames costs one move of the buffer, not one
    /// per frame (which made a flood of pings quadratic in the read size).
    consumed: usize,
    /// fds with the stream offset of the last byte of the read that carried them. The
    /// kernel ends a read right after the segment that carries fds, but may begin it
    /// with earlier segments (frames sent before, not yet read): the last byte, not
    /// the first, lies in the segment the fds came with, which starts the frame they
    /// belong to.
    fds: VecDeque<(u64, PeerFd)>,
    /// Replies are encoded straight into this buffer; `output[output_sent..]` waits to
    /// be sent. Emptied (capacity kept) once all of it is sent, so a ping's reply is
    /// written into memory the connection already holds.
    output: Vec<u8>,
    /// Bytes at the front of `output` already sent.
    output_sent: usize,
    /// Stream offset of `output[0]`.
    output_offset: u64,
    /// Replies that carry fds: `(first byte, end)` stream offsets and the fds, which
    /// ride on the `sendmsg` of the reply's first byte.
    output_fds: VecDeque<(u64, u64, Vec<OwnedFd>)>,
    max_input_bytes: usize,
    max_output_bytes: usize,
    /// Close once the output is flushed and no request runs on the pool (after
    /// bad_frame / too_large, or once the peer has shut down its sending side).
    pub close_after_flush: bool,
    /// Whether writable readiness is registered for the socket: only while output
    /// waits on a full socket buffer.
    pub writable_interest: bool,
    /// How reads go: with `recvmsg` until the peer promises to send no more fds (the
    /// node's [`ReadWithoutFds`]), then with plain `read` once the kernel refuses fds to
    /// the socket and every fd queued before that was taken
    /// ([`Connection::promise_no_fds`]).
    ///
    /// [`ReadWithoutFds`]: kvwarden_core::node::PeerAction::ReadWithoutFds
    fd_reads: FdReads,
    /// When the frame now arriving began: its first byte was read (or, for the first
    /// frame, the connection was accepted). None while no partial frame is buffered.
    frame_started: Option<std::time::Instant>,
    /// Its [`Connection::memory`] as the server last counted it in its total.
    pub counted_memory: usize,
}

impl Connection {
    /// A connection whose input holds at most one frame of `max_frame_bytes` plus a
    /// read chunk, and whose output holds at most `max_output_bytes`.
    pub fn new(
        stream: PeerSocket,
        peer: Credentials,
        max_frame_bytes: usize,
        max_output_bytes: usize,
    ) -> Connection {
        Connection {
            stream,
            peer,
            input: Vec::new(),
            input_offset: 0,
            consumed: 0,
            fds: VecDeque::new(),
            output: Vec::new(),
            output_sent: 0,
            output_offset: 0,
            output_fds: VecDeque::new(),
            max_input_bytes: LENGTH_PREFIX_BYTES + max_frame_bytes + READ_CHUNK_BYTES,
            max_output_bytes,
            close_after_flush: false,
            writable_interest: false,
            fd_reads: FdReads::Recvmsg,
            frame_started: Some(std::time::Instant::now()),
            counted_memory: 0,
        }
    }

    /// The peer promised to send no more fds: from now on the kernel refuses them
    /// (`SO_PASSRIGHTS` off, Linux 6.16) and, once what was queued before is read, the
    /// connection is read with plain `read`, as TCP is. On an older kernel it stays on
    /// `recvmsg`: an fd sent anyway then arrives, matches no frame, and is closed off
    /// the loop as a stray. (A plain `read` over a queued fd would make the kernel close
    /// it on this thread.) Returns whether the kernel refuses fds now.
    pub fn promise_no_fds(&mut self) -> bool {
        let PeerSocket::Unix(stream) = &self.stream else {
            return false;
        };
        if self.fd_reads != FdReads::Recvmsg {
            return true;
        }
        let off: libc::c_int = 0;
        // SAFETY: a valid socket fd and a c_int option value of the size passed.
        let refused = unsafe {
            libc::setsockopt(
                std::os::fd::AsRawFd::as_raw_fd(stream),
                libc::SOL_SOCKET,
                SO_PASSRIGHTS,
                std::ptr::from_ref(&off).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        } == 0;
        if refused {
            self.fd_reads = FdReads::Draining;
        }
        refused
    }

    /// fds received that no complete frame has taken yet.
    pub fn held_fds(&self) -> usize {
        self.fds.len()
    }

    /// Call after the frames read were handled: starts the clock of a partial frame
    /// (at the first call that sees it), and gives back buffers that are empty but grew
    /// past four read chunks (one big frame or reply must not keep a megabyte per idle
    /// connection). Returns the bytes its buffers hold now.
    pub fn settle(&mut self, now: std::time::Instant) -> usize {
        if self.consumed < self.input.len() {
            self.frame_started.get_or_insert(now);
        } else if self.input.capacity() > 4 * READ_CHUNK_BYTES {
            self.input_offset += self.input.len() as u64;
            self.consumed = 0;
            self.input = Vec::new();
        }
        self.shrink_output();
        self.memory()
    }

    /// Gives back an output buffer that is empty but grew past four read chunks.
    pub fn shrink_output(&mut self) {
        if self.output.is_empty() && self.output.capacity() > 4 * READ_CHUNK_BYTES {
            self.output = Vec::new();
        }
    }

    /// The bytes its input and output buffers hold (their capacity).
    pub fn memory(&self) -> usize {
        self.input.capacity() + self.output.capacity()
    }

    /// Whether a frame has been arriving for longer than `timeout` (or the first frame
    /// has not arrived within it of the accept): a slow or stalled peer.
    pub fn frame_overdue(&self, now: std::time::Instant, timeout: std::time::Duration) -> bool {
        self.frame_started
            .is_some_and(|started| now.saturating_duration_since(started) > timeout)
    }

    /// One read (one system call), up to the input bound.
    pub fn read(&mut self) -> io::Result<SocketRead> {
        if self.consumed > 0 {
            self.input.drain(..self.consumed);
            self.input_offset += self.consumed as u64;
            self.consumed = 0;
        }
        // One read buffer for the event loop's thread: a fresh 64 KiB stack buffer per
        // read meant a 64 KiB memset per ping (12 % of the server's cycles under load).
        thread_local! {
            static CHUNK: std::cell::RefCell<Box<[u8]>> =
                std::cell::RefCell::new(vec![0u8; READ_CHUNK_BYTES].into_boxed_slice());
        }
        CHUNK.with(|chunk| self.read_into(&mut chunk.borrow_mut()))
    }

    fn read_into(&mut self, chunk: &mut [u8]) -> io::Result<SocketRead> {
        loop {
            let room = self.max_input_bytes.saturating_sub(self.input.len());
            if room == 0 {
                return Ok(SocketRead::Full);
            }
            let want = room.min(READ_CHUNK_BYTES);
            let offset = self.input_offset + self.input.len() as u64;
            let mut ancillary = false;
            let read = match &mut self.stream {
                PeerSocket::Tcp(stream) => stream.read(&mut chunk[..want]),
                PeerSocket::Unix(stream) if self.fd_reads == FdReads::Plain => {
                    stream.read(&mut chunk[..want])
                }
                PeerSocket::Unix(stream) => {
                    let mut space =
                        [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(RECV_FDS))];
                    let mut control = RecvAncillaryBuffer::new(&mut space);
                    let mut iov = [IoSliceMut::new(&mut chunk[..want])];
                    let result = rustix::net::recvmsg(
                        &*stream,
                        &mut iov,
                        &mut control,
                        RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT,
                    );
                    match result {
                        Ok(message) => {
                            let last = offset + message.bytes.saturating_sub(1) as u64;
                            for item in control.drain() {
                                ancillary = true;
                                if let RecvAncillaryMessage::ScmRights(fds) = item {
                                    for fd in fds {
                                        self.fds.push_back((last, PeerFd::new(fd)));
                                    }
                                }
                            }
                            // Draining reads on until a read finds the queue empty.
                            ancillary |= self.fd_reads == FdReads::Draining;
                            Ok(message.bytes)
                        }
                        Err(rustix::io::Errno::AGAIN) if self.fd_reads == FdReads::Draining => {
                            self.fd_reads = FdReads::Plain;
                            Err(io::Error::from(rustix::io::Errno::AGAIN))
                        }
                        Err(errno) => Err(io::Error::from(errno)),
                    }
                }
            };
            return match read {
                Ok(0) => Ok(SocketRead::Closed),
                Ok(n) => {
                    self.input.extend_from_slice(&chunk[..n]);
                    if n < want && !ancillary {
                        Ok(SocketRead::Drained)
                    } else {
                        Ok(SocketRead::Data)
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(SocketRead::WouldBlock),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => Err(e),
            };
        }
    }

    /// The next complete frame, if one is buffered, its body handed to `read_body` in
    /// place (borrowed from the input buffer: a ping is decoded without a copy). fds
    /// that arrived before the frame and were used by no frame are closed here.
    pub fn next_frame<T>(
        &mut self,
        max_frame_bytes: usize,
        read_body: impl FnOnce(&[u8]) -> T,
    ) -> Result<Option<Frame<T>>, FrameError> {
        let pending = &self.input[self.consumed..];
        let Some(body_len) = parse_header(pending, max_frame_bytes)? else {
            return Ok(None);
        };
        let total = LENGTH_PREFIX_BYTES + body_len;
        if pending.len() < total {
            return Ok(None);
        }
        let start = self.input_offset + self.consumed as u64;
        let end = start + total as u64;
        while self.fds.front().is_some_and(|(at, _)| *at < start) {
            self.fds.pop_front(); // stray fds: closed on drop
        }
        let mut fds = Vec::new();
        while self.fds.front().is_some_and(|(at, _)| *at < end) {
            if let Some((_, fd)) = self.fds.pop_front() {
                fds.push(fd);
            }
        }
        let body = read_body(&self.input[self.consumed + LENGTH_PREFIX_BYTES..][..body_len]);
        self.consumed += total;
        self.frame_started = None;
        Ok(Some(Frame { body, fds }))
    }

    /// Appends what `write` puts in the output buffer. None, and nothing queued, when
    /// the output bound would be exceeded: the peer does not read its replies and must
    /// be disconnected. Otherwise the stream offsets of the first byte and the end.
    fn append(&mut self, write: impl FnOnce(&mut Vec<u8>)) -> Option<(u64, u64)> {
        if self.output_sent > 0 {
            // Only after a partial send (a peer slow to read): move the rest to the
            // front once, rather than once per reply.
            self.output.drain(..self.output_sent);
            self.output_offset += self.output_sent as u64;
            self.output_sent = 0;
        }
        let before = self.output.len();
        write(&mut self.output);
        if self.output.len() > self.max_output_bytes {
            self.output.truncate(before);
            return None;
        }
        let start = self.output_offset + before as u64;
        Some((start, self.output_offset + self.output.len() as u64))
    }

    /// Queues bytes to send. false when the output bound would be exceeded: the peer
    /// does not read its replies and must be disconnected.
    pub fn queue(&mut self, bytes: &[u8]) -> bool {
        self.append(|out| out.extend_from_slice(bytes)).is_some()
    }

    /// Encodes a reply straight into the output buffer (no allocation once the buffer
    /// has grown to the connection's working size). false as for [`Connection::queue`].
    pub fn queue_reply(&mut self, request_id: u64, result: &Result<Value, ProtocolError>) -> bool {
        self.append(|out| encode_reply_into(out, request_id, result))
            .is_some()
    }

    /// Whether another reply carrying fds may be queued now.
    pub fn has_room_for_fd_reply(&self) -> bool {
        self.output_fds.len() < MAX_QUEUED_FD_REPLIES
    }

    /// Queues a reply that carries `fds` (`SCM_RIGHTS` on its first byte). false when
    /// the output bound would be exceeded, as for [`Connection::queue`], or when
    /// [`MAX_QUEUED_FD_REPLIES`] such replies already wait: the peer does not read.
    pub fn queue_with_fds(&mut self, bytes: &[u8], fds: Vec<OwnedFd>) -> bool {
        self.append_with_fds(|out| out.extend_from_slice(bytes), fds)
    }

    /// [`Connection::queue_reply`] for a reply that carries `fds`, bounded as
    /// [`Connection::queue_with_fds`].
    pub fn queue_reply_with_fds(
        &mut self,
        request_id: u64,
        result: &Result<Value, ProtocolError>,
        fds: Vec<OwnedFd>,
    ) -> bool {
        self.append_with_fds(|out| encode_reply_into(out, request_id, result), fds)
    }

    fn append_with_fds(&mut self, write: impl FnOnce(&mut Vec<u8>), fds: Vec<OwnedFd>) -> bool {
        if self.output_fds.len() >= MAX_QUEUED_FD_REPLIES {
            return false;
        }
        let Some((start, end)) = self.append(write) else {
            return false;
        };
        if !fds.is_empty() {
            self.output_fds.push_back((start, end, fds));
        }
        true
    }

    /// Writes what the socket takes. Err on a broken connection.
    ///
    /// A reply that carries fds is sent by a `sendmsg` of its own bytes only, so that
    /// its fds ride on its first byte and no other reply shares that segment (a reader
    /// that meets fds knows they belong to the frame the segment holds).
    pub fn flush(&mut self) -> io::Result<()> {
        while self.has_output() {
            let next_fds = self
                .output_fds
                .front()
                .map(|(start, end, _)| (*start, *end));
            let head = &self.output[self.output_sent..];
            let sent_to = self.output_offset + self.output_sent as u64;
            let (limit, carries_fds) = match next_fds {
                Some((start, end)) if start <= sent_to => ((end - sent_to) as usize, true),
                Some((start, _)) => ((start - sent_to) as usize, false),
                None => (usize::MAX, false),
            };
            let chunk = &head[..head.len().min(limit)];
            let written = match (&mut self.stream, carries_fds) {
                (PeerSocket::Unix(stream), true) => {
                    let fds: Vec<rustix::fd::BorrowedFd<'_>> = self
                        .output_fds
                        .front()
                        .map(|(_, _, fds)| fds.iter().map(|fd| fd.as_fd()).collect())
                        .unwrap_or_default();
                    let mut space =
                        vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
                    let mut control = SendAncillaryBuffer::new(&mut space);
                    if control.push(SendAncillaryMessage::ScmRights(&fds)) {
                        rustix::net::sendmsg(
                            &*stream,
                            &[io::IoSlice::new(chunk)],
                            &mut control,
                            SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
                        )
                        .map_err(io::Error::from)
                    } else {
                        Err(io::Error::other("too many fds for one reply"))
                    }
                }
                (PeerSocket::Unix(stream), false) => stream.write(chunk),
                (PeerSocket::Tcp(stream), _) => stream.write(chunk),
            };
            match written {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    if carries_fds {
                        // Sent with the first byte; our copies close here.
                        self.output_fds.pop_front();
                    }
                    self.output_sent += n.min(chunk.len());
                    if self.output_sent == self.output.len() {
                        // All sent: the buffer is reused from its start.
                        self.output_offset += self.output.len() as u64;
                        self.output.clear();
                        self.output_sent = 0;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Whether output is waiting.
    pub fn has_output(&self) -> bool {
        self.output_sent < self.output.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::encode_frame;
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

    fn send(socket: &std::os::unix::net::UnixStream, bytes: &[u8], fds: &[OwnedFd]) {
        assert_eq!(try_send(socket, bytes, fds), Ok(bytes.len()));
    }

    fn try_send(
        socket: &std::os::unix::net::UnixStream,
        bytes: &[u8],
        fds: &[OwnedFd],
    ) -> rustix::io::Result<usize> {
        let borrowed: Vec<_> = fds.iter().map(rustix::fd::AsFd::as_fd).collect();
        let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !borrowed.is_empty() {
            assert!(control.push(SendAncillaryMessage::ScmRights(&borrowed)));
        }
        rustix::net::sendmsg(
            socket,
            &[io::IoSlice::new(bytes)],
            &mut control,
            SendFlags::empty(),
        )
    }

    fn connection() -> (Connection, std::os::unix::net::UnixStream) {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let stream = PeerSocket::Unix(mio::net::UnixStream::from_std(ours));
        (
            Connection::new(stream, Credentials::default(), 1024, 1 << 20),
            theirs,
        )
    }

    fn read_all(connection: &mut Connection) {
        while matches!(
            connection.read().unwrap(),
            SocketRead::Data | SocketRead::Drained
        ) {}
    }

    /// A burst of small frames is handed out in order, and fds go to the frame whose
    /// first byte they came with even when the kernel hands them out in one read with
    /// earlier, still unread frames (a pipelining client), across the lazy compaction
    /// of the input buffer.
    #[test]
    fn frames_of_a_burst_come_out_in_order_with_their_fds() {
        let (mut connection, peer) = connection();
        let frames: Vec<Vec<u8>> = (0u8..200).map(|n| encode_frame(&[n; 3])).collect();
        send(&peer, &frames[..100].concat(), &[]);
        let memfd = crate::memfd::create("fd", 16).unwrap();
        send(&peer, &frames[100], &[memfd]);
        send(&peer, &frames[101..150].concat(), &[]);
        read_all(&mut connection);
        for n in 0u8..150 {
            let frame = connection
                .next_frame(1024, <[u8]>::to_vec)
                .unwrap()
                .expect("a buffered frame");
            assert_eq!(frame.body, vec![n; 3]);
            assert_eq!(frame.fds.len(), usize::from(n == 100), "frame {n}");
        }
        assert!(connection.next_frame(1024, |_| ()).unwrap().is_none());
        // Half a frame, then the rest after a read that compacts the buffer.
        send(&peer, &frames[150][..5], &[]);
        read_all(&mut connection);
        assert!(connection.next_frame(1024, |_| ()).unwrap().is_none());
        let before = [&frames[150][5..], &frames[151..160].concat()].concat();
        send(&peer, &before, &[]);
        let memfds = [0, 1].map(|_| crate::memfd::create("fd", 16).unwrap());
        send(&peer, &frames[160], &memfds);
        send(&peer, &frames[161..].concat(), &[]);
        read_all(&mut connection);
        for n in 150u8..200 {
            let frame = connection
                .next_frame(1024, <[u8]>::to_vec)
                .unwrap()
                .expect("a buffered frame");
            assert_eq!(frame.body, vec![n; 3]);
            assert_eq!(frame.fds.len(), if n == 160 { 2 } else { 0 }, "frame {n}");
        }
        assert_eq!(
            connection.input_offset + connection.consumed as u64,
            200 * 7
        );
    }

    /// A promise of no more fds makes the kernel refuse them (the sender's `sendmsg`
    /// fails with `EPERM`) and the connection is read with plain `read` once the queue
    /// was found empty; an fd queued before the promise is still taken by a `recvmsg`
    /// (a plain `read` would make the kernel close it on the reading thread) and goes
    /// with its frame. On a kernel without `SO_PASSRIGHTS` the late fd arrives too.
    #[test]
    fn a_promise_of_no_fds_makes_the_kernel_refuse_them_and_queued_ones_are_taken() {
        let (mut connection, peer) = connection();
        let frames: Vec<Vec<u8>> = (0u8..3).map(|n| encode_frame(&[n; 3])).collect();
        send(
            &peer,
            &frames[0],
            &[crate::memfd::create("fd", 16).unwrap()],
        );
        let refused = connection.promise_no_fds();
        assert_eq!(connection.fd_reads != FdReads::Recvmsg, refused);
        let late = [crate::memfd::create("late", 16).unwrap()];
        let sent = try_send(&peer, &frames[1], &late);
        if refused {
            assert_eq!(
                sent,
                Err(rustix::io::Errno::PERM),
                "the kernel refuses the fd"
            );
            send(&peer, &frames[1], &[]);
        } else {
            assert_eq!(sent, Ok(frames[1].len()));
        }
        send(&peer, &frames[2], &[]);
        read_all(&mut connection);
        let expected_mode = if refused {
            FdReads::Plain
        } else {
            FdReads::Recvmsg
        };
        assert_eq!(connection.fd_reads, expected_mode);
        for n in 0u8..3 {
            let frame = connection
                .next_frame(1024, <[u8]>::to_vec)
                .unwrap()
                .expect("a buffered frame");
            assert_eq!(frame.body, vec![n; 3]);
            let expected = match n {
                0 => 1,
                1 => usize::from(!refused),
                _ => 0,
            };
            assert_eq!(frame.fds.len(), expected, "frame {n}");
        }
    }

    /// Replies carrying fds go out each on a sendmsg of its own with its fds, in
    /// order with the plain replies around them; at most two wait unsent.
    #[test]
    fn replies_with_fds_carry_them_on_their_own_segment() {
        let (mut connection, peer) = connection();
        let replies: Vec<Vec<u8>> = (0u8..6).map(|n| encode_frame(&[n; 5])).collect();
        for (n, reply) in replies.iter().enumerate() {
            if n % 2 == 1 {
                assert!(connection.has_room_for_fd_reply() || connection.flush().is_ok());
                let fd = crate::memfd::create("fd", 16).unwrap();
                assert!(connection.queue_with_fds(reply, vec![fd]), "reply {n}");
            } else {
                assert!(connection.queue(reply));
            }
        }
        connection.flush().unwrap();
        assert!(!connection.has_output());
        let mut received: Vec<(Vec<u8>, usize)> = Vec::new();
        let mut total = 0;
        while total < replies.iter().map(Vec::len).sum::<usize>() {
            let mut chunk = [0u8; 256];
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let mut iov = [IoSliceMut::new(&mut chunk)];
            let message =
                rustix::net::recvmsg(&peer, &mut iov, &mut control, RecvFlags::empty()).unwrap();
            let fds = control
                .drain()
                .map(|m| match m {
                    RecvAncillaryMessage::ScmRights(fds) => fds.count(),
                    _ => 0,
                })
                .sum();
            total += message.bytes;
            received.push((chunk[..message.bytes].to_vec(), fds));
        }
        // Every read that brought fds ended with the whole reply they belong to.
        let with_fds: Vec<&(Vec<u8>, usize)> = received.iter().filter(|(_, n)| *n > 0).collect();
        assert_eq!(with_fds.len(), 3, "{received:?}");
        for (bytes, count) in with_fds {
            assert_eq!(*count, 1);
            assert!(
                [&replies[1], &replies[3], &replies[5]]
                    .iter()
                    .any(|reply| bytes.ends_with(reply)),
                "{bytes:?}"
            );
        }
        let all: Vec<u8> = received.into_iter().flat_map(|(bytes, _)| bytes).collect();
        assert_eq!(all, replies.concat());
        // Two unsent replies with fds fill the queue: a third is refused.
        peer.set_nonblocking(true).unwrap();
        for _ in 0..2 {
            let fd = crate::memfd::create("fd", 16).unwrap();
            assert!(connection.queue_with_fds(&replies[1], vec![fd]));
        }
        assert!(!connection.has_room_for_fd_reply());
        let fd = crate::memfd::create("fd", 16).unwrap();
        assert!(!connection.queue_with_fds(&replies[1], vec![fd]));
    }

    /// A peer slow to read: the output leaves in pieces over many flushes, replies
    /// queued meanwhile (which move the unsent rest to the front of the buffer) keep
    /// their order, a reply's fds arrive with a read that ends inside that reply, and
    /// the buffer is reused from its start once all of it is sent.
    #[test]
    fn output_sent_in_pieces_keeps_order_and_fds() {
        let (mut connection, peer) = connection();
        peer.set_nonblocking(true).unwrap();
        let replies: Vec<Vec<u8>> = (0u32..240)
            .map(|n| encode_frame(&vec![(n % 251) as u8; 4096 + n as usize]))
            .collect();
        let fd_reply = 130;
        let fd_start: usize = replies[..fd_reply].iter().map(Vec::len).sum();
        let fd_end = fd_start + replies[fd_reply].len();
        let total: usize = replies.iter().map(Vec::len).sum();
        let mut queued = 0;
        let mut received: Vec<u8> = Vec::new();
        let mut fd_read_ends = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        let mut partial_flushes = 0;
        while received.len() < total {
            // Queue a few more, then send what the socket takes, then read a little.
            for _ in 0..20 {
                if queued == replies.len() {
                    break;
                }
                let queued_ok = if queued == fd_reply {
                    let fd = crate::memfd::create("fd", 16).unwrap();
                    connection.queue_with_fds(&replies[queued], vec![fd])
                } else {
                    connection.queue(&replies[queued])
                };
                assert!(queued_ok, "reply {queued}");
                queued += 1;
            }
            connection.flush().unwrap();
            partial_flushes += usize::from(connection.has_output());
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let mut iov = [IoSliceMut::new(&mut chunk[..16 * 1024])];
            match rustix::net::recvmsg(&peer, &mut iov, &mut control, RecvFlags::empty()) {
                Ok(message) => {
                    let fds: usize = control
                        .drain()
                        .map(|m| match m {
                            RecvAncillaryMessage::ScmRights(fds) => fds.count(),
                            _ => 0,
                        })
                        .sum();
                    received.extend_from_slice(&chunk[..message.bytes]);
                    if fds > 0 {
                        fd_read_ends.push((received.len(), fds));
                    }
                }
                Err(rustix::io::Errno::AGAIN) => {}
                Err(error) => panic!("recvmsg: {error}"),
            }
        }
        assert!(
            partial_flushes > 0,
            "the socket buffer filled at least once"
        );
        assert_eq!(received, replies.concat());
        assert_eq!(fd_read_ends.len(), 1, "{fd_read_ends:?}");
        let (end, count) = fd_read_ends[0];
        assert_eq!(count, 1);
        assert!(
            end > fd_start && end <= fd_end,
            "the read with the fd ended at {end}, outside the reply at {fd_start}..{fd_end}"
        );
        assert!(!connection.has_output());
        assert_eq!(connection.output.len(), 0, "emptied once all was sent");
        assert_eq!(connection.output_offset, total as u64);
    }
}
