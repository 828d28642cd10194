//! A raw protocol client over a real socket, and a TCP proxy that can cut a connection.

use crate::instance_secret;
use kvwarden_core::protocol::{Reply, decode_reply, encode_request};
use rmpv::Value;
use rustix::fd::{AsFd, BorrowedFd};
use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A raw protocol client over the Unix socket: arbitrary bytes, fds, requests.
pub struct RawClient {
    /// The socket.
    pub stream: UnixStream,
    next_id: u64,
}

impl RawClient {
    /// Connects (no hello).
    pub fn connect(path: &Path) -> std::io::Result<RawClient> {
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        Ok(RawClient { stream, next_id: 1 })
    }

    /// Connects and attaches `instance` (with [`instance_secret`]).
    pub fn connect_attached(path: &Path, instance: u64) -> RawClient {
        let mut client = RawClient::connect(path).expect("connecting to the server");
        client.attach(instance);
        client
    }

    /// `attach [instance, instance_secret(instance)]`; panics unless the server answers
    /// `claimed` or `proven`, which it returns.
    pub fn attach(&mut self, instance: u64) -> String {
        let reply = self
            .attach_with(instance, &instance_secret(instance))
            .expect("a reply to attach");
        let value = reply
            .result
            .unwrap_or_else(|e| panic!("attach of instance {instance} refused: {e}"));
        let outcome = kvwarden::server::status::msgpack_to_json(&value)["outcome"]
            .as_str()
            .map(str::to_owned);
        match outcome.as_deref() {
            Some("claimed" | "proven") => outcome.unwrap_or_default(),
            _ => panic!("attach of instance {instance}: unexpected reply {value}"),
        }
    }

    /// `attach [instance, secret]`: the raw reply.
    pub fn attach_with(&mut self, instance: u64, secret: &[u8]) -> std::io::Result<Reply> {
        self.request(
            "attach",
            vec![instance.into(), Value::Binary(secret.to_vec())],
        )
    }

    /// Sends raw bytes.
    pub fn send_bytes(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// Sends raw bytes with fds on the first byte.
    pub fn send_with_fds(&mut self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
        use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
        let mut space =
            vec![std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
        let sent = rustix::net::sendmsg(
            self.stream.as_fd(),
            &[IoSlice::new(bytes)],
            &mut control,
            SendFlags::NOSIGNAL,
        )?;
        self.stream.write_all(&bytes[sent..])
    }

    /// Reads one reply frame.
    pub fn read_reply(&mut self) -> std::io::Result<Reply> {
        let mut prefix = [0u8; 4];
        self.stream.read_exact(&mut prefix)?;
        let mut body = vec![0u8; u32::from_be_bytes(prefix) as usize];
        self.stream.read_exact(&mut body)?;
        decode_reply(&body).map_err(|e| std::io::Error::other(e.to_string()))
    }

    /// Whether the server closed the connection (EOF within the read timeout).
    pub fn is_closed_by_server(&mut self) -> bool {
        let mut byte = [0u8; 1];
        matches!(self.stream.read(&mut byte), Ok(0))
    }

    /// The framed request with a fresh id.
    pub fn frame(&mut self, op: &str, args: Vec<Value>) -> (u64, Vec<u8>) {
        let id = self.next_id;
        self.next_id += 1;
        (id, encode_request(id, op, args))
    }

    /// Sends a request and reads its reply.
    pub fn request(&mut self, op: &str, args: Vec<Value>) -> std::io::Result<Reply> {
        let (id, frame) = self.frame(op, args);
        self.send_bytes(&frame)?;
        let reply = self.read_reply()?;
        assert_eq!(reply.id, id, "reply to the request just sent");
        Ok(reply)
    }

    /// Sends a request with fds and reads its reply.
    pub fn request_with_fds(
        &mut self,
        op: &str,
        args: Vec<Value>,
        fds: &[BorrowedFd<'_>],
    ) -> std::io::Result<Reply> {
        let (id, frame) = self.frame(op, args);
        self.send_with_fds(&frame, fds)?;
        let reply = self.read_reply()?;
        assert_eq!(reply.id, id, "reply to the request just sent");
        Ok(reply)
    }
}

/// A memfd buffer spec for `register_kv_cache`.
pub fn memfd_spec(fd_index: u64, nbytes: u64) -> Value {
    kvwarden_core::protocol::BufferSpec::Memfd { fd_index, nbytes }.to_value()
}

/// A TCP proxy between workers and the server's TCP listener that a test can cut
/// (every connection dropped, new ones refused) and heal.
pub struct Proxy {
    /// Where workers connect.
    pub addr: SocketAddr,
    cut: Arc<AtomicBool>,
    live: Arc<Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    /// A proxy to `upstream`.
    pub fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy listener");
        let addr = listener.local_addr().expect("proxy address");
        let cut = Arc::new(AtomicBool::new(false));
        let live: Arc<Mutex<Vec<TcpStream>>> = Arc::new(Mutex::new(Vec::new()));
        let (cut2, live2) = (Arc::clone(&cut), Arc::clone(&live));
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if cut2.load(Ordering::SeqCst) {
                    continue; // dropped: the partition refuses everyone
                }
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                let pipes = [
                    (client.try_clone(), server.try_clone()),
                    (server.try_clone(), client.try_clone()),
                ];
                {
                    let mut live = live2.lock().unwrap_or_else(|e| e.into_inner());
                    live.push(client);
                    live.push(server);
                }
                for (from, to) in pipes {
                    if let (Ok(mut from), Ok(mut to)) = (from, to) {
                        std::thread::spawn(move || {
                            let _ = std::io::copy(&mut from, &mut to);
                            let _ = to.shutdown(std::net::Shutdown::Both);
                        });
                    }
                }
            }
        });
        Proxy { addr, cut, live }
    }

    /// Starts a partition: every connection broken, new ones dropped.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        for stream in live.drain(..) {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Ends the partition.
    pub fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

// ------------------------------------------------------------------ other uids
