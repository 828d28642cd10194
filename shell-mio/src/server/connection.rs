//! One worker connection: bounded input and output buffers, `SCM_RIGHTS` fds matched to
//! the frame whose first byte they arrived with, and the peer's credentials.

use crate::protocol::{FrameError, LENGTH_PREFIX_BYTES, parse_header};
use rustix::fd::OwnedFd;
use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
use std::collections::VecDeque;
use std::io::{self, IoSliceMut, Read, Write};
use std::mem::MaybeUninit;

/// The most fds one `recvmsg` accepts; more are truncated by the kernel (and closed).
const MAX_FDS_PER_READ: usize = 32;
/// Bytes read per system call.
const READ_CHUNK_BYTES: usize = 64 * 1024;

/// The transport of a connection.
#[derive(Debug)]
pub enum Stream {
    /// Unix socket: carries fds, proves the peer.
    Unix(mio::net::UnixStream),
    /// TCP: neither.
    Tcp(mio::net::TcpStream),
}

impl Stream {
    /// The mio source.
    pub fn source(&mut self) -> &mut dyn mio::event::Source {
        match self {
            Stream::Unix(stream) => stream,
            Stream::Tcp(stream) => stream,
        }
    }
}

/// Who is at the other end, as the kernel says (Unix socket only).
#[derive(Debug, Default)]
pub struct Peer {
    /// The peer's uid; None over TCP.
    pub uid: Option<u32>,
    /// The peer's pid, when visible in this PID namespace.
    pub pid: Option<i32>,
    /// A pidfd of the peer process, taken at accept time.
    pub pidfd: Option<OwnedFd>,
}

/// A complete frame and the fds that came with it.
#[derive(Debug)]
pub struct Frame {
    /// The MessagePack body.
    pub body: Vec<u8>,
    /// fds that arrived with the frame's bytes, in arrival order.
    pub fds: Vec<OwnedFd>,
}

/// What a read found.
#[derive(Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    /// Bytes arrived; there may be more.
    Data,
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
    pub stream: Stream,
    /// The peer.
    pub peer: Peer,
    input: Vec<u8>,
    /// Stream offset of `input[0]`.
    input_offset: u64,
    /// fds with the stream offset of the first byte of the read that carried them.
    fds: VecDeque<(u64, OwnedFd)>,
    output: VecDeque<u8>,
    max_input_bytes: usize,
    max_output_bytes: usize,
    /// Close once the output is flushed (after bad_frame / too_large).
    pub close_after_flush: bool,
    /// Requests of this connection still running on the pool.
    pub in_flight: usize,
}

impl Connection {
    /// A connection whose input holds at most one frame of `max_frame_bytes` plus a
    /// read chunk, and whose output holds at most `max_output_bytes`.
    pub fn new(
        stream: Stream,
        peer: Peer,
        max_frame_bytes: usize,
        max_output_bytes: usize,
    ) -> Connection {
        Connection {
            stream,
            peer,
            input: Vec::new(),
            input_offset: 0,
            fds: VecDeque::new(),
            output: VecDeque::new(),
            max_input_bytes: LENGTH_PREFIX_BYTES + max_frame_bytes + READ_CHUNK_BYTES,
            max_output_bytes,
            close_after_flush: false,
            in_flight: 0,
        }
    }

    /// One read (one system call), up to the input bound.
    pub fn read(&mut self) -> io::Result<ReadOutcome> {
        let mut chunk = [0u8; READ_CHUNK_BYTES];
        loop {
            let room = self.max_input_bytes.saturating_sub(self.input.len());
            if room == 0 {
                return Ok(ReadOutcome::Full);
            }
            let want = room.min(READ_CHUNK_BYTES);
            let offset = self.input_offset + self.input.len() as u64;
            let read = match &mut self.stream {
                Stream::Tcp(stream) => stream.read(&mut chunk[..want]),
                Stream::Unix(stream) => {
                    let mut space =
                        [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_READ))];
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
                            for item in control.drain() {
                                if let RecvAncillaryMessage::ScmRights(fds) = item {
                                    for fd in fds {
                                        self.fds.push_back((offset, fd));
                                    }
                                }
                            }
                            Ok(message.bytes)
                        }
                        Err(errno) => Err(io::Error::from(errno)),
                    }
                }
            };
            return match read {
                Ok(0) => Ok(ReadOutcome::Closed),
                Ok(n) => {
                    self.input.extend_from_slice(&chunk[..n]);
                    Ok(ReadOutcome::Data)
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(ReadOutcome::WouldBlock),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => Err(e),
            };
        }
    }

    /// The next complete frame, if one is buffered. fds that arrived before the frame
    /// and were used by no frame are closed here.
    pub fn next_frame(&mut self, max_frame_bytes: usize) -> Result<Option<Frame>, FrameError> {
        let Some(body_len) = parse_header(&self.input, max_frame_bytes)? else {
            return Ok(None);
        };
        let total = LENGTH_PREFIX_BYTES + body_len;
        if self.input.len() < total {
            return Ok(None);
        }
        let start = self.input_offset;
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
        let body = self.input[LENGTH_PREFIX_BYTES..total].to_vec();
        self.input.drain(..total);
        self.input_offset = end;
        Ok(Some(Frame { body, fds }))
    }

    /// Queues bytes to send. false when the output bound would be exceeded: the peer
    /// does not read its replies and must be disconnected.
    pub fn queue(&mut self, bytes: &[u8]) -> bool {
        if self.output.len() + bytes.len() > self.max_output_bytes {
            return false;
        }
        self.output.extend(bytes);
        true
    }

    /// Writes what the socket takes. Err on a broken connection.
    pub fn flush(&mut self) -> io::Result<()> {
        while !self.output.is_empty() {
            let (head, _) = self.output.as_slices();
            let written = match &mut self.stream {
                Stream::Unix(stream) => stream.write(head),
                Stream::Tcp(stream) => stream.write(head),
            };
            match written {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.output.drain(..n);
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
        !self.output.is_empty()
    }
}
