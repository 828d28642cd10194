//! The client's blocking connection: frames out (with fds as `SCM_RIGHTS`), replies in.

use super::ClientError;
use kvwarden_core::protocol::{
    LENGTH_PREFIX_BYTES, Op, PROTOCOL_VERSION, decode_reply, encode_request,
};
use rmpv::Value;
use rustix::fd::BorrowedFd;
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
}

impl Wire {
    /// Connects and says hello.
    pub fn connect(
        endpoint: &Endpoint,
        client_name: &str,
        timeout: Duration,
    ) -> Result<Wire, ClientError> {
        let name = endpoint.to_string();
        let io = |source| ClientError::Io {
            endpoint: name.clone(),
            source,
        };
        let socket = match endpoint {
            Endpoint::Unix(path) => Socket::Unix(UnixStream::connect(path).map_err(io)?),
            Endpoint::Tcp(addr) => {
                let stream = TcpStream::connect_timeout(addr, timeout).map_err(io)?;
                let _ = stream.set_nodelay(true);
                Socket::Tcp(stream)
            }
        };
        let mut wire = Wire {
            socket,
            endpoint: name.clone(),
        };
        let args = Op::Hello {
            protocol: PROTOCOL_VERSION,
            client: client_name.to_owned(),
        }
        .args();
        wire.call(0, "hello", args, &[], timeout)?;
        Ok(wire)
    }

    fn io(&self, source: std::io::Error) -> ClientError {
        ClientError::Io {
            endpoint: self.endpoint.clone(),
            source,
        }
    }

    /// Sends one request and waits up to `timeout` for its reply.
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
        loop {
            let body = self.receive(timeout).map_err(|e| self.io(e))?;
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
