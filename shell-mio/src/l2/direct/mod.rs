//! The data path to Redis: one connection per node, speaking RESP itself, so that a
//! value's bytes go from the socket straight to where they belong (a reserved L1 slot)
//! and a slot's bytes from the pool straight to the socket, with no intermediate
//! buffer of the value's size. redis-rs keeps the rest: finding out what the seeds are,
//! the cluster's slot map (`CLUSTER SLOTS`), existence checks, deletes, and every
//! command that is redirected (`MOVED`, `ASK`): then the caller retries through it and
//! asks for a fresh map ([`Direct::mark_stale`]).
//!
//! Commands to one node are pipelined: a thread sends every `GETRANGE` (or `SET`) of a
//! batch that goes to a node in one write, then reads the replies in order.
//!
//! Each connection presents the configured credentials (`AUTH`), is TLS (rustls, the
//! server's certificate verified against `--l2-tls-ca-file` or the system's roots)
//! exactly when the seeds are `rediss://`, is `TCP_NODELAY`, and every connect, send and
//! receive gives up after the L2 timeout (a payload's receive: at the read's deadline).

use std::io::{self, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod nodes;
mod replay;
pub(super) use nodes::{Addr, Link, cluster_nodes};
pub use replay::{Asked, ReplyRead, read_replies};

/// Redis Cluster's hash slots.
const SLOTS: u16 = 16_384;

/// Bytes read from a socket at a time for replies other than a payload (and for the
/// first bytes of a payload that arrive with its reply line).
const READ_BUFFER_BYTES: usize = 64 << 10;

/// The hash slot of `name`: CRC16 (XMODEM) of its hash tag (`{…}`) or of all of it.
pub(super) fn hash_slot(name: &[u8]) -> u16 {
    let tagged = name
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &name[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(name);
    crc16::State::<crc16::XMODEM>::calculate(tagged) % SLOTS
}

/// A socket, plain or TLS.
pub(super) enum RedisStream {
    Plain(TcpStream),
    Tls(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
}

impl RedisStream {
    fn tcp(&self) -> &TcpStream {
        match self {
            RedisStream::Plain(tcp) => tcp,
            RedisStream::Tls(tls) => &tls.sock,
        }
    }
}

impl Read for RedisStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            RedisStream::Plain(tcp) => tcp.read(buf),
            RedisStream::Tls(tls) => tls.read(buf),
        }
    }
}

impl Write for RedisStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            RedisStream::Plain(tcp) => tcp.write(buf),
            RedisStream::Tls(tls) => tls.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            RedisStream::Plain(tcp) => tcp.write_vectored(bufs),
            RedisStream::Tls(tls) => tls.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            RedisStream::Plain(tcp) => tcp.flush(),
            RedisStream::Tls(tls) => tls.flush(),
        }
    }
}

/// The start of a reply.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Head {
    /// A bulk string of this many bytes (which follow, then CRLF); None: nil.
    Bulk(Option<usize>),
    /// `+…`.
    Simple(String),
    /// `-…`.
    Error(String),
    /// `:…`.
    Integer(i64),
    /// Anything else (an array, a RESP3 type): never asked for here.
    Other(u8),
}

/// An error reply that is a redirection (`MOVED`, `ASK`): retry through redis-rs.
pub(super) fn is_redirect(message: &str) -> bool {
    message.starts_with("MOVED ") || message.starts_with("ASK ")
}

/// The reply is not RESP as Redis writes it.
fn protocol_error(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("L2 reply: {what}"))
}

/// A reply of a shape the command never has: the rest of it is not read, so the
/// connection goes (the caller drops it), never misreading the replies after it.
fn unexpected(command: &str, head: &Head) -> io::Error {
    protocol_error(&format!(
        "{command} answered {head:?}, a reply of a shape it never has; the connection is dropped"
    ))
}

/// What a `GETRANGE` answered, its reply consumed whole but for a value's bytes.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum GetReply {
    /// No such key: nil, or an empty string (no value is empty), its CRLF consumed.
    Absent,
    /// A value of this many bytes (at least 1, at most the limit asked plus one)
    /// follows, then CRLF: the caller reads them or skips them ([`NodeConn::skip_bulk`]).
    Value(usize),
    /// An error reply (a redirection, `WRONGTYPE`, a refusal), consumed whole.
    Error(String),
    /// A value of this many bytes, longer than the command ever answers: not Redis, or
    /// not a value of ours, and not worth reading past; none of it is read, so the
    /// connection must go.
    TooLong(usize),
}

/// What a `SET` answered, its reply consumed whole.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum SetReply {
    /// `+OK`.
    Stored,
    /// An error reply (a redirection, a refusal).
    Error(String),
}

/// A socket a [`NodeConn`] reads replies from: the real one, or (in tests and the
/// `l2_replies` fuzz target) bytes arriving in parts.
pub(super) trait Socket: Read + Write {
    /// Bounds each receive from now on.
    fn set_read_timeout(&self, timeout: Duration) -> io::Result<()>;

    /// One receive into `out`, given up (`TimedOut`) once `deadline` passes: every wait
    /// on the socket is bounded by the time left (row 59). `read_timeout` is the
    /// socket's read timeout now, lowered towards the deadline.
    fn receive(
        &mut self,
        out: &mut [u8],
        deadline: Instant,
        read_timeout: &mut Duration,
    ) -> io::Result<usize> {
        if let Some(lowered) = lowered_timeout(read_timeout, deadline)? {
            self.set_read_timeout(lowered)?;
        }
        self.read(out)
    }
}

impl Socket for RedisStream {
    fn set_read_timeout(&self, timeout: Duration) -> io::Result<()> {
        self.tcp().set_read_timeout(Some(timeout))
    }

    /// Over TLS, rustls's own stream would read on until a whole record arrived,
    /// however long its bytes trickle in (a record of 16 KiB at a byte per 40 ms is 11
    /// minutes): here each socket read is one step, checked against the deadline
    /// before it is made, and the records are fed to rustls read by read.
    fn receive(
        &mut self,
        out: &mut [u8],
        deadline: Instant,
        read_timeout: &mut Duration,
    ) -> io::Result<usize> {
        let tls = match self {
            RedisStream::Plain(tcp) => {
                if let Some(lowered) = lowered_timeout(read_timeout, deadline)? {
                    tcp.set_read_timeout(Some(lowered))?;
                }
                return tcp.read(out);
            }
            RedisStream::Tls(tls) => tls,
        };
        loop {
            match tls.conn.reader().read(out) {
                Ok(read) => return Ok(read),
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                Err(error) => return Err(error),
            }
            if let Some(lowered) = lowered_timeout(read_timeout, deadline)? {
                tls.sock.set_read_timeout(Some(lowered))?;
            }
            let arrived = tls.conn.read_tls(&mut tls.sock)?;
            tls.conn
                .process_new_packets()
                .map_err(|error| io::Error::new(io::ErrorKind::InvalidData, error))?;
            while tls.conn.wants_write() {
                tls.conn.write_tls(&mut tls.sock)?;
            }
            if arrived == 0 {
                // The peer closed: what rustls decrypted is read above, then the end.
                return match tls.conn.reader().read(out) {
                    Ok(read) => Ok(read),
                    Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                        Err(io::ErrorKind::UnexpectedEof.into())
                    }
                    Err(error) => Err(error),
                };
            }
        }
    }
}

/// The read timeout a socket needs now (`Some`) on the way to `deadline`, lowered in
/// halving steps so that a payload arriving at speed costs no system call (`None`:
/// `read_timeout` still fits); `TimedOut` once the deadline passed.
fn lowered_timeout(read_timeout: &mut Duration, deadline: Instant) -> io::Result<Option<Duration>> {
    let left = deadline
        .checked_duration_since(Instant::now())
        .filter(|left| !left.is_zero())
        .ok_or(io::ErrorKind::TimedOut)?;
    if left < *read_timeout / 2 {
        *read_timeout = left;
        return Ok(Some(left));
    }
    Ok(None)
}

/// One connection to one Redis node.
pub(super) struct NodeConn<S: Socket = RedisStream> {
    stream: S,
    buffer: Box<[u8]>,
    start: usize,
    end: usize,
    timeout: Duration,
    /// The socket's read timeout now (lowered towards a read's deadline).
    read_timeout: Duration,
}

impl NodeConn {
    /// Connects to `addr` and authenticates, each step bounded by the link's timeout.
    pub(super) fn connect(addr: &Addr, link: &Link) -> io::Result<NodeConn> {
        let timeout = link.timeout;
        let target: SocketAddr = (addr.host.as_str(), addr.port)
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| io::Error::other(format!("{}: no address", addr.host)))?;
        let tcp = TcpStream::connect_timeout(&target, timeout)?;
        tcp.set_nodelay(true)?;
        tcp.set_read_timeout(Some(timeout))?;
        tcp.set_write_timeout(Some(timeout))?;
        #[cfg(target_os = "linux")]
        {
            let user = super::connection::user_timeout(timeout);
            rustix::net::sockopt::set_tcp_user_timeout(
                &tcp,
                u32::try_from(user.as_millis()).unwrap_or(u32::MAX),
            )?;
        }
        let stream = match &link.tls {
            None => RedisStream::Plain(tcp),
            Some(tls) => {
                let name = rustls::pki_types::ServerName::try_from(addr.host.clone())
                    .map_err(|error| io::Error::other(format!("{}: {error}", addr.host)))?;
                let connection = rustls::ClientConnection::new(Arc::clone(tls), name)
                    .map_err(io::Error::other)?;
                RedisStream::Tls(Box::new(rustls::StreamOwned::new(connection, tcp)))
            }
        };
        let mut conn = NodeConn::over(stream, timeout);
        if let Some(password) = &link.password {
            let mut command = Vec::new();
            match &link.username {
                Some(user) => encode(
                    &mut command,
                    &[b"AUTH", user.as_bytes(), password.as_bytes()],
                ),
                None => encode(&mut command, &[b"AUTH", password.as_bytes()]),
            }
            conn.send(&mut [IoSlice::new(&command)])?;
            match conn.head()? {
                Head::Simple(_) => {}
                Head::Error(message) => {
                    return Err(io::Error::new(io::ErrorKind::PermissionDenied, message));
                }
                other => return Err(protocol_error(&format!("AUTH answered {other:?}"))),
            }
        }
        Ok(conn)
    }
}

impl<S: Socket> NodeConn<S> {
    /// Replies read from `stream`, each receive bounded by `timeout`.
    pub(super) fn over(stream: S, timeout: Duration) -> NodeConn<S> {
        NodeConn {
            stream,
            buffer: vec![0; READ_BUFFER_BYTES].into_boxed_slice(),
            start: 0,
            end: 0,
            timeout,
            read_timeout: timeout,
        }
    }

    /// Reads the reply to a `GETRANGE name 0 limit_bytes`: the whole reply but for a
    /// value's bytes. A reply of another shape is an error after which the connection
    /// must go, as after [`GetReply::TooLong`].
    pub(super) fn get_reply(&mut self, limit_bytes: u64) -> io::Result<GetReply> {
        match self.head()? {
            Head::Bulk(None) => Ok(GetReply::Absent),
            Head::Bulk(Some(0)) => {
                self.crlf()?;
                Ok(GetReply::Absent)
            }
            Head::Bulk(Some(len)) if len as u64 > limit_bytes.saturating_add(1) => {
                Ok(GetReply::TooLong(len))
            }
            Head::Bulk(Some(len)) => Ok(GetReply::Value(len)),
            Head::Error(message) => Ok(GetReply::Error(message)),
            head => Err(unexpected("GETRANGE", &head)),
        }
    }

    /// Reads the reply to a `SET`, whole. A reply of another shape is an error after
    /// which the connection must go.
    pub(super) fn set_reply(&mut self) -> io::Result<SetReply> {
        match self.head()? {
            Head::Simple(_) => Ok(SetReply::Stored),
            Head::Error(message) => Ok(SetReply::Error(message)),
            head => Err(unexpected("SET", &head)),
        }
    }

    /// Writes all of `slices`.
    pub(super) fn send(&mut self, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
        IoSlice::advance_slices(&mut slices, 0);
        while !slices.is_empty() {
            let written = self.stream.write_vectored(slices)?;
            if written == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            IoSlice::advance_slices(&mut slices, written);
        }
        self.stream.flush()
    }

    fn fill(&mut self) -> io::Result<()> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.end == self.buffer.len() {
            self.buffer.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        // A reply line must come within the timeout, however it trickles in.
        let deadline = Instant::now() + self.timeout;
        let read = self.stream.receive(
            &mut self.buffer[self.end..],
            deadline,
            &mut self.read_timeout,
        )?;
        if read == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.end += read;
        Ok(())
    }

    /// The next line (without its CRLF).
    fn line(&mut self) -> io::Result<Vec<u8>> {
        loop {
            let held = &self.buffer[self.start..self.end];
            if let Some(at) = held.windows(2).position(|pair| pair == b"\r\n") {
                let line = held[..at].to_vec();
                self.start += at + 2;
                return Ok(line);
            }
            if self.end - self.start == self.buffer.len() {
                return Err(protocol_error("a reply line longer than the read buffer"));
            }
            self.fill()?;
        }
    }

    /// Reads the start of the next reply (the whole of it but for a bulk string's bytes
    /// and CRLF, or an array's elements).
    pub(super) fn head(&mut self) -> io::Result<Head> {
        let line = self.line()?;
        let (&kind, rest) = line
            .split_first()
            .ok_or_else(|| protocol_error("an empty line"))?;
        let text = || String::from_utf8_lossy(rest).into_owned();
        let number = || -> io::Result<i64> {
            std::str::from_utf8(rest)
                .ok()
                .and_then(|text| text.parse().ok())
                .ok_or_else(|| protocol_error("a length or integer that is not a number"))
        };
        Ok(match kind {
            b'$' => match number()? {
                -1 => Head::Bulk(None),
                len => Head::Bulk(Some(
                    usize::try_from(len).map_err(|_| protocol_error("a negative length"))?,
                )),
            },
            b'+' => Head::Simple(text()),
            b'-' => Head::Error(text()),
            b':' => Head::Integer(number()?),
            other => Head::Other(other),
        })
    }

    /// Reads exactly `out.len()` bytes of a bulk string into `out`: what the read buffer
    /// holds first, the rest straight from the socket, handing each part to `seen` as it
    /// arrives. With `deadline`, gives up (`TimedOut`) once it passes, each receive
    /// bounded by the time left.
    pub(super) fn read_exact_into(
        &mut self,
        out: &mut [u8],
        deadline: Option<Instant>,
        mut seen: impl FnMut(&[u8]),
    ) -> io::Result<()> {
        let buffered = (self.end - self.start).min(out.len());
        out[..buffered].copy_from_slice(&self.buffer[self.start..self.start + buffered]);
        seen(&out[..buffered]);
        self.start += buffered;
        let mut filled = buffered;
        let result = (|| {
            while filled < out.len() {
                let deadline = deadline.unwrap_or_else(|| Instant::now() + self.timeout);
                let read =
                    self.stream
                        .receive(&mut out[filled..], deadline, &mut self.read_timeout)?;
                if read == 0 {
                    return Err(io::ErrorKind::UnexpectedEof.into());
                }
                seen(&out[filled..filled + read]);
                filled += read;
            }
            Ok(())
        })();
        if self.read_timeout != self.timeout {
            self.read_timeout = self.timeout;
            self.stream.set_read_timeout(self.timeout)?;
        }
        result
    }

    /// Skips the last `nbytes` of a bulk string and its CRLF.
    pub(super) fn skip_bulk(&mut self, mut nbytes: usize) -> io::Result<()> {
        while nbytes > 0 {
            if self.start == self.end {
                self.fill()?;
            }
            let taken = (self.end - self.start).min(nbytes);
            self.start += taken;
            nbytes -= taken;
        }
        self.crlf()
    }

    /// The CRLF after a bulk string.
    pub(super) fn crlf(&mut self) -> io::Result<()> {
        let mut crlf = [0u8; 2];
        self.read_exact_into(&mut crlf, None, |_| {})?;
        if &crlf == b"\r\n" {
            Ok(())
        } else {
            Err(protocol_error("a bulk string not followed by CRLF"))
        }
    }
}

/// Appends the RESP array of `args` to `out`.
pub(super) fn encode(out: &mut Vec<u8>, args: &[&[u8]]) {
    encode_start(out, args.len(), args);
}

/// Appends the start of a RESP array of `count` arguments, of which `args` are the
/// first; the caller sends the rest (each as `$LEN\r\n…\r\n`).
pub(super) fn encode_start(out: &mut Vec<u8>, count: usize, args: &[&[u8]]) {
    out.push(b'*');
    out.extend_from_slice(count.to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
    encode_args(out, args);
}

/// Appends each of `args` as a bulk string (arguments after an array's start).
pub(super) fn encode_args(out: &mut Vec<u8>, args: &[&[u8]]) {
    for arg in args {
        encode_bulk_start(out, arg.len());
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
}

/// Appends `$LEN\r\n`.
pub(super) fn encode_bulk_start(out: &mut Vec<u8>, len: usize) {
    out.push(b'$');
    out.extend_from_slice(len.to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Where each hash slot's master is, as `CLUSTER SLOTS` said (or the one node of a
/// plain Redis), with this thread's connection to each.
pub(super) struct Direct {
    link: Arc<Link>,
    nodes: Vec<(Addr, Option<NodeConn>)>,
    /// The node of each hash slot (an index into `nodes`); empty: one node, every slot.
    owner: Vec<u16>,
    stale: bool,
}

impl Direct {
    /// One plain Redis at `addr`.
    pub(super) fn single(link: Arc<Link>, addr: Addr) -> Direct {
        Direct {
            link,
            nodes: vec![(addr, None)],
            owner: Vec::new(),
            stale: false,
        }
    }

    /// A cluster whose map could not be read: no slot has a node (every command goes
    /// through redis-rs), and the map is read again before the next batch.
    pub(super) fn unmapped(link: Arc<Link>) -> Direct {
        Direct {
            link,
            nodes: Vec::new(),
            owner: vec![u16::MAX; usize::from(SLOTS)],
            stale: true,
        }
    }

    /// A cluster, from the reply to `CLUSTER SLOTS`; `seed` stands for a node whose
    /// address the reply leaves empty (the node that answered).
    pub(super) fn cluster(
        link: Arc<Link>,
        slots: &redis::Value,
        seed: &Addr,
    ) -> Result<Direct, String> {
        let mut direct = Direct::unmapped(link);
        direct.set_map(slots, seed)?;
        Ok(direct)
    }

    /// Replaces the slot map (keeping the connections to nodes still in it).
    pub(super) fn set_map(&mut self, slots: &redis::Value, seed: &Addr) -> Result<(), String> {
        use redis::Value;
        let Value::Array(ranges) = slots else {
            return Err(format!("CLUSTER SLOTS answered {slots:?}"));
        };
        let mut owner = vec![u16::MAX; usize::from(SLOTS)];
        let mut nodes: Vec<(Addr, Option<NodeConn>)> = Vec::new();
        for range in ranges {
            let Value::Array(fields) = range else {
                return Err(format!("a CLUSTER SLOTS range is {range:?}"));
            };
            let (Some(Value::Int(first)), Some(Value::Int(last)), Some(Value::Array(master))) =
                (fields.first(), fields.get(1), fields.get(2))
            else {
                return Err(format!("a CLUSTER SLOTS range is {fields:?}"));
            };
            let host = match master.first() {
                Some(Value::BulkString(host)) => String::from_utf8_lossy(host).into_owned(),
                Some(Value::SimpleString(host)) => host.clone(),
                _ => String::new(),
            };
            let Some(Value::Int(port)) = master.get(1) else {
                return Err(format!("a CLUSTER SLOTS master is {master:?}"));
            };
            let addr = Addr {
                host: if host.is_empty() || host == "?" {
                    seed.host.clone()
                } else {
                    host
                },
                port: u16::try_from(*port).map_err(|_| format!("a port of {port}"))?,
            };
            let index = match nodes.iter().position(|(known, _)| *known == addr) {
                Some(index) => index,
                None => {
                    let kept = self
                        .nodes
                        .iter_mut()
                        .find(|(known, _)| *known == addr)
                        .and_then(|(_, conn)| conn.take());
                    nodes.push((addr, kept));
                    nodes.len() - 1
                }
            };
            let (first, last) = (
                usize::try_from(*first).unwrap_or(usize::MAX),
                usize::try_from(*last).unwrap_or(0),
            );
            for slot in owner.iter_mut().take(last.saturating_add(1)).skip(first) {
                *slot = u16::try_from(index).unwrap_or(u16::MAX);
            }
        }
        self.nodes = nodes;
        self.owner = owner;
        self.stale = false;
        Ok(())
    }

    /// Whether a redirection said the map is out of date.
    pub(super) fn stale(&self) -> bool {
        self.stale
    }

    /// Asks for a fresh map before the next batch (after a redirection).
    pub(super) fn mark_stale(&mut self) {
        self.stale = true;
    }

    /// The node that serves `name`: None when no master serves its slot (the map
    /// has a hole: the cluster is failing over).
    pub(super) fn node_of(&self, name: &[u8]) -> Option<usize> {
        if self.owner.is_empty() {
            return Some(0);
        }
        let index = *self.owner.get(usize::from(hash_slot(name)))?;
        (usize::from(index) < self.nodes.len()).then_some(usize::from(index))
    }

    /// Drops the connection to node `index` (after an error: it may be mid-reply) and
    /// asks for a fresh map.
    pub(super) fn broken(&mut self, index: usize) {
        if let Some((_, conn)) = self.nodes.get_mut(index) {
            *conn = None;
        }
        self.stale = true;
    }

    /// The connection to node `index`, made when missing.
    pub(super) fn conn(&mut self, index: usize) -> io::Result<&mut NodeConn> {
        let (addr, conn) = self
            .nodes
            .get_mut(index)
            .ok_or_else(|| io::Error::other("no such L2 node"))?;
        if conn.is_none() {
            *conn = Some(NodeConn::connect(addr, &self.link)?);
        }
        conn.as_mut()
            .ok_or_else(|| io::Error::other("no connection"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `bytes` read as the replies to `asked`, each byte arriving on its own.
    fn read_bytewise(bytes: &[u8], asked: &[Asked]) -> Vec<Result<ReplyRead, String>> {
        let parts = bytes.iter().map(|&byte| vec![byte]).collect();
        read_replies(parts, asked, 1 << 20)
    }

    #[test]
    fn a_miss_is_consumed_whole_and_the_hit_after_it_is_read_as_itself() {
        // GETRANGE of a missing key answers an empty string (`$0`); nil too, for a GET.
        let bytes = b"$0\r\n\r\n$5\r\nhello\r\n$-1\r\n$0\r\n\r\n$2\r\nhi\r\n";
        for read in [
            read_replies(vec![bytes.to_vec()], &[Asked::Get; 5], 1 << 20),
            read_bytewise(bytes, &[Asked::Get; 5]),
        ] {
            assert_eq!(
                read,
                vec![
                    Ok(ReplyRead::Absent),
                    Ok(ReplyRead::Value(b"hello".to_vec())),
                    Ok(ReplyRead::Absent),
                    Ok(ReplyRead::Absent),
                    Ok(ReplyRead::Value(b"hi".to_vec())),
                ]
            );
        }
    }

    #[test]
    fn error_replies_are_consumed_whole_and_answered_as_errors() {
        let bytes = b"-MOVED 3999 127.0.0.1:6381\r\n$1\r\nx\r\n-OOM no\r\n+OK\r\n";
        assert_eq!(
            read_bytewise(bytes, &[Asked::Get, Asked::Get, Asked::Set, Asked::Set]),
            vec![
                Ok(ReplyRead::Error("MOVED 3999 127.0.0.1:6381".into())),
                Ok(ReplyRead::Value(b"x".to_vec())),
                Ok(ReplyRead::Error("OOM no".into())),
                Ok(ReplyRead::Stored),
            ]
        );
    }

    #[test]
    fn a_reply_of_a_shape_the_command_never_has_ends_the_reading() {
        // An array, an integer, a simple string to a GETRANGE; a bulk string to a SET;
        // a value longer than asked: each an error, and nothing after it is read.
        for (bytes, asked) in [
            (&b"*1\r\n$1\r\nx\r\n$1\r\ny\r\n"[..], Asked::Get),
            (b":1\r\n$1\r\ny\r\n", Asked::Get),
            (b"+OK\r\n$1\r\ny\r\n", Asked::Get),
            (b"$1\r\nx\r\n+OK\r\n", Asked::Set),
            (b"$3\r\nabc\r\n$1\r\ny\r\n", Asked::Get),
            (b"$1\r\nxy\r\n$1\r\ny\r\n", Asked::Get),
            (b"\r\n$1\r\ny\r\n", Asked::Get),
        ] {
            let read = read_replies(vec![bytes.to_vec()], &[asked, Asked::Get], 1);
            assert_eq!(
                read.len(),
                1,
                "{:?}: {read:?}",
                String::from_utf8_lossy(bytes)
            );
            assert!(
                read[0].is_err(),
                "{:?}: {read:?}",
                String::from_utf8_lossy(bytes)
            );
        }
    }

    #[test]
    fn hash_slots_are_redis_clusters() {
        // The values of the Redis Cluster specification's examples.
        assert_eq!(hash_slot(b"123456789"), 0x31c3 % SLOTS);
        assert_eq!(hash_slot(b"foo"), 12_182);
        assert_eq!(hash_slot(b"{user1000}.following"), hash_slot(b"user1000"));
        assert_eq!(hash_slot(b"foo{}{bar}"), hash_slot(b"foo{}{bar}"));
        assert_ne!(
            hash_slot(b"foo{}{bar}"),
            hash_slot(b"bar"),
            "an empty tag is no tag"
        );
        assert_eq!(hash_slot(b"foo{{bar}}zap"), hash_slot(b"{bar"));
    }

    #[test]
    fn commands_are_resp_arrays_of_bulk_strings() {
        let mut out = Vec::new();
        encode(&mut out, &[b"GETRANGE", b"k", b"0", b"10"]);
        assert_eq!(
            out,
            b"*4\r\n$8\r\nGETRANGE\r\n$1\r\nk\r\n$1\r\n0\r\n$2\r\n10\r\n".to_vec()
        );
    }
}
