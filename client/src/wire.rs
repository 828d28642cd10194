//! The client's blocking connection: frames out (with fds as `SCM_RIGHTS`), replies in.

use super::{ClientConfig, ClientError};
use kvwarden_core::protocol::tcp_auth::{Nonce, TcpKey};
use kvwarden_core::protocol::{
    Challenge, HelloReply, LENGTH_PREFIX_BYTES, Op, PROTOCOL_VERSION, ReplyValue, decode_reply,
    encode_request,
};
use rmpv::Value;
use rustix::fd::{AsFd, BorrowedFd};
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use std::io::{IoSlice, Read, Write};
use std::mem::MaybeUninit;
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

/// The largest reply the client accepts.
const MAX_REPLY_BYTES: usize = 64 << 20;

/// Where the server listens.
#[derive(Clone, Debug)]
pub enum Endpoint {
    /// A Unix socket path.
    Unix(PathBuf),
    /// A TCP address (no fds, no process-exit proof).
    Tcp(SocketAddr),
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Unix(path) => write!(f, "unix:{}", path.display()),
            Endpoint::Tcp(addr) => write!(f, "tcp:{addr}"),
        }
    }
}

enum Socket {
    Unix(UnixStream),
    Tcp(TcpStream),
}

/// One connection.
pub struct Wire {
    socket: Socket,
    endpoint: String,
    /// How the server said it will notice this process's death (`hello`'s
    /// `exit_proof`; None from a server that does not say).
    pub exit_proof: Option<String>,
    /// The server's reap timeout (`hello`'s `reap_timeout_seconds`; None from a server
    /// that does not say).
    pub reap_timeout: Option<Duration>,
}

impl Wire {
    /// Connects and says hello; over a Unix socket with `send_pidfd`, the hello
    /// carries a pidfd of this process (the server's proof of its death in every PID
    /// namespace layout). Over a Unix socket the server's uid is checked first: nothing,
    /// no fd above all, goes to a server this client does not trust.
    pub fn connect(config: &ClientConfig) -> Result<Wire, ClientError> {
        let endpoint = &config.endpoint;
        let client_name = &config.client_name;
        let timeout = config.request_timeout;
        let send_pidfd = config.send_pidfd;
        let name = endpoint.to_string();
        let io = |source| ClientError::Io {
            endpoint: name.clone(),
            source,
        };
        let socket = match endpoint {
            Endpoint::Unix(path) => {
                let stream = UnixStream::connect(path).map_err(io)?;
                check_server_uid(
                    &stream,
                    &path.display().to_string(),
                    &config.trusted_server_uids,
                )?;
                Socket::Unix(stream)
            }
            Endpoint::Tcp(addr) => {
                let stream = TcpStream::connect_timeout(addr, timeout).map_err(io)?;
                let _ = stream.set_nodelay(true);
                Socket::Tcp(stream)
            }
        };
        let mut wire = Wire {
            socket,
            endpoint: name.clone(),
            exit_proof: None,
            reap_timeout: None,
        };
        // Over TCP: the server proves it holds the token before this client proves it
        // does; the token itself never travels.
        let proof = match endpoint {
            Endpoint::Tcp(_) => Some(wire.auth(config, timeout)?),
            Endpoint::Unix(_) => None,
        };
        let hello_args = |pidfd_index| {
            Op::Hello {
                protocol: PROTOCOL_VERSION,
                client: client_name.to_owned(),
                pidfd_index,
                // The worker's buffers (memfds) travel on this connection.
                sends_fds: true,
                token: None,
                proof: proof.clone(),
                // The server starts no copy into this worker's buffers past it.
                wait_ms: Some(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)),
            }
            .args()
        };
        let pidfd = match (&wire.socket, send_pidfd) {
            (Socket::Unix(_), true) => own_pidfd(),
            _ => None,
        };
        if let Some(pidfd) = pidfd {
            match wire.call(0, "hello", hello_args(Some(0)), &[pidfd.as_fd()], timeout) {
                Ok(hello) => {
                    wire.said_hello(&hello);
                    return Ok(wire);
                }
                // An older server (it takes two arguments) or one that cannot check
                // pidfds: the connection is still good; say hello without it.
                Err(ClientError::Server { error, .. }) => tracing::warn!(
                    %error,
                    "the server refused this worker's pidfd; carrying on without it (its \
                     death is then noticed by pid where the server can see it, else only \
                     by the reap timeout)"
                ),
                Err(other) => return Err(other),
            }
        }
        let hello = wire.call(0, "hello", hello_args(None), &[], timeout)?;
        wire.said_hello(&hello);
        Ok(wire)
    }

    /// `auth` over TCP: sends the token's key id and a fresh nonce, checks the server's
    /// proof, and returns this client's proof for `hello`. A server that cannot prove
    /// it holds the token gets nothing more.
    fn auth(&mut self, config: &ClientConfig, timeout: Duration) -> Result<Vec<u8>, ClientError> {
        let Some(token) = &config.tcp_token else {
            return Err(ClientError::NoTcpToken {
                endpoint: self.endpoint.clone(),
            });
        };
        let key = TcpKey::from_token(token);
        let mut nonce: Nonce = [0; 32];
        getrandom::fill(&mut nonce)
            .map_err(|error| ClientError::Local(format!("no randomness for a nonce: {error}")))?;
        let endpoint = self.endpoint.clone();
        let not_proven = |why: String| ClientError::ServerNotProven { endpoint, why };
        let args = Op::Auth {
            id: key.id(),
            nonce,
        }
        .args();
        let reply = match self.call(0, "auth", args, &[], timeout) {
            Ok(reply) => reply,
            // An older server (protocol 2) does not know `auth`.
            Err(ClientError::Server { error, .. })
                if error.code == kvwarden_core::protocol::ErrorCode::UnknownOp =>
            {
                return Err(not_proven(format!(
                    "it does not know `auth` ({}): a server older than protocol \
                     {PROTOCOL_VERSION} takes the token in `hello`, which this client no \
                     longer sends; upgrade the server",
                    error.message
                )));
            }
            Err(other) => return Err(other),
        };
        let Some(challenge) = Challenge::from_value(&reply) else {
            return Err(not_proven(format!("`auth` answered {reply}")));
        };
        if !key.check_server(&nonce, &challenge.nonce, &challenge.proof) {
            return Err(not_proven("its proof is wrong".into()));
        }
        Ok(key.client_proof(&nonce, &challenge.nonce).to_vec())
    }

    /// Keeps what the `hello` reply says that the client acts on.
    /// A reply that is not this protocol's `hello` (an older server's) tells nothing.
    fn said_hello(&mut self, hello: &Value) {
        let Some(hello) = HelloReply::from_value(hello) else {
            tracing::warn!(reply = %hello, "the server's hello reply lacks fields of this protocol; is it older than this client?");
            return;
        };
        self.exit_proof = Some(hello.exit_proof);
        self.reap_timeout = Duration::try_from_secs_f64(hello.reap_timeout_seconds).ok();
    }

    fn io(&self, source: std::io::Error) -> ClientError {
        ClientError::Io {
            endpoint: self.endpoint.clone(),
            source,
        }
    }

    /// Sends one request and waits up to `timeout` for its reply. A request that writes
    /// into the worker's memory (`retrieve`, `retrieve_batch`) and times out waits up to
    /// [`WRITE_DRAIN`] more for its answer before the error is returned: the server
    /// starts no copy into the destination past the connection's `wait_ms` (the
    /// request timeout), and its answer comes once a copy already running has ended, so
    /// the caller may reuse the destination once this returns (the connection is then
    /// dropped by the caller).
    pub fn call(
        &mut self,
        id: u64,
        op: &str,
        args: Vec<Value>,
        fds: &[BorrowedFd<'_>],
        timeout: Duration,
    ) -> Result<Value, ClientError> {
        let frame = encode_request(id, op, args);
        self.send(&frame, fds).map_err(|e| self.io(e))?;
        let timeout = timeout.max(Duration::from_millis(1));
        let writes_memory = matches!(op, "retrieve" | "retrieve_batch");
        loop {
            let body = match self.receive(timeout) {
                Ok(body) => body,
                Err(error) if writes_memory && is_timeout(&error) => {
                    self.drain_answer(id);
                    return Err(self.io(error));
                }
                Err(error) => return Err(self.io(error)),
            };
            let reply = decode_reply(&body).map_err(|e| ClientError::Reply {
                op: op.to_string(),
                detail: e.to_string(),
            })?;
            if reply.id != id {
                continue; // a late reply to an earlier request
            }
            return reply.result.map_err(|error| ClientError::Server {
                op: op.to_string(),
                error,
            });
        }
    }

    /// After a timed-out request that writes into the worker's memory: reads replies
    /// for up to [`WRITE_DRAIN`] until request `id`'s answer came (the destination is
    /// then free), or the time is up.
    fn drain_answer(&mut self, id: u64) {
        let until = std::time::Instant::now() + WRITE_DRAIN;
        while let Some(left) = until.checked_duration_since(std::time::Instant::now()) {
            match self.receive(left.max(Duration::from_millis(1))) {
                Ok(body) if decode_reply(&body).is_ok_and(|reply| reply.id == id) => return,
                Ok(_) => {}
                Err(_) => return,
            }
        }
    }

    fn send(&mut self, frame: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
        match &mut self.socket {
            Socket::Tcp(stream) => stream.write_all(frame),
            Socket::Unix(stream) => {
                let mut sent = 0;
                if !fds.is_empty() {
                    // fds ride on the sendmsg that carries the frame's first byte.
                    let mut space =
                        vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
                    let mut control = SendAncillaryBuffer::new(&mut space);
                    if !control.push(SendAncillaryMessage::ScmRights(fds)) {
                        return Err(std::io::Error::other("too many fds for one message"));
                    }
                    sent = rustix::net::sendmsg(
                        &*stream,
                        &[IoSlice::new(frame)],
                        &mut control,
                        SendFlags::NOSIGNAL,
                    )?;
                }
                stream.write_all(&frame[sent..])
            }
        }
    }

    fn receive(&mut self, timeout: Duration) -> std::io::Result<Vec<u8>> {
        let reader: &mut dyn Read = match &mut self.socket {
            Socket::Unix(stream) => {
                stream.set_read_timeout(Some(timeout))?;
                stream
            }
            Socket::Tcp(stream) => {
                stream.set_read_timeout(Some(timeout))?;
                stream
            }
        };
        let mut prefix = [0u8; LENGTH_PREFIX_BYTES];
        reader.read_exact(&mut prefix)?;
        let length = u32::from_be_bytes(prefix) as usize;
        if length == 0 || length > MAX_REPLY_BYTES {
            return Err(std::io::Error::other(format!(
                "reply frame of {length} bytes"
            )));
        }
        let mut body = vec![0u8; length];
        reader.read_exact(&mut body)?;
        Ok(body)
    }
}

/// How long a timed-out `retrieve` or `retrieve_batch` waits on for its answer, so that
/// no copy the server started before the deadline still runs into the destination.
pub const WRITE_DRAIN: Duration = Duration::from_secs(1);

fn is_timeout(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// A pidfd of this process, or None where the kernel has no `pidfd_open` (before 5.3).
fn own_pidfd() -> Option<rustix::fd::OwnedFd> {
    let pid = rustix::process::getpid();
    match rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) {
        Ok(pidfd) => Some(pidfd),
        Err(error) => {
            tracing::debug!(%error, "pidfd_open(getpid()) failed; hello goes without a pidfd");
            None
        }
    }
}

/// Refuses a server whose uid is neither root, ours, nor one the config trusts.
fn check_server_uid(stream: &UnixStream, socket: &str, trusted: &[u32]) -> Result<(), ClientError> {
    let credentials =
        rustix::net::sockopt::socket_peercred(stream).map_err(|error| ClientError::Io {
            endpoint: format!("unix:{socket}"),
            source: error.into(),
        })?;
    let uid = credentials.uid.as_raw();
    let own_uid = rustix::process::getuid().as_raw();
    if uid == 0 || uid == own_uid || trusted.contains(&uid) {
        return Ok(());
    }
    Err(ClientError::UntrustedServer {
        socket: socket.to_owned(),
        uid,
        own_uid,
        trusted: trusted.to_vec(),
    })
}
