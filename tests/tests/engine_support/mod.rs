//! Shared by the engine-driven, blend and `/dev/shm` tests: an engine-driven worker
//! speaking the raw protocol (it receives the L1 pool's memfd, maps it and writes and
//! reads slots itself), and a helper process that does the same and then waits to be
//! killed, for the process-exit paths.
//!
//! The helper process is this very test binary, re-run with `--exact <helper test>`
//! and `KVWARDEN_HELPER_*` variables; its `#[test]` returns at once when they are unset.

#![allow(dead_code)] // each test binary uses a part

use kvwarden::memfd::SharedMapping;
use kvwarden_core::protocol::{Reply, decode_reply};
use kvwarden_tests::{PATIENCE, RawClient};
use rmpv::Value;
use rustix::fd::OwnedFd;
use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
use std::io::{BufRead, BufReader, IoSliceMut};
use std::mem::MaybeUninit;
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A slot granted by `prepare_store` / `prepare_retrieve`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    pub offset: u64,
    pub nbytes: u64,
}

/// An engine-driven worker on a raw connection, with the pool mapped.
pub struct EngineWorker {
    pub raw: RawClient,
    pub instance: u64,
    pub pool: SharedMapping,
    pub slot_bytes: u64,
    pub num_slots: u64,
    pub outcome: String,
}

fn field<'a>(value: &'a Value, key: &str) -> Option<&'a Value> {
    match value {
        Value::Map(map) => map
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v),
        _ => None,
    }
}

fn uint(value: &Value, key: &str) -> u64 {
    field(value, key)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("{key} missing in {value}"))
}

/// Sends a request and reads its reply with the fds that came with it.
pub fn request_receiving_fds(
    raw: &mut RawClient,
    op: &str,
    args: Vec<Value>,
) -> (Reply, Vec<OwnedFd>) {
    let (id, frame) = raw.frame(op, args);
    raw.send_bytes(&frame).expect("sending");
    let mut bytes: Vec<u8> = Vec::new();
    let mut fds = Vec::new();
    loop {
        if bytes.len() >= 4 {
            let len = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize;
            if bytes.len() >= 4 + len {
                assert_eq!(bytes.len(), 4 + len, "exactly one reply");
                let reply = decode_reply(&bytes[4..]).expect("a reply");
                assert_eq!(reply.id, id);
                return (reply, fds);
            }
        }
        let mut chunk = [0u8; 4096];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let mut iov = [IoSliceMut::new(&mut chunk)];
        let received =
            rustix::net::recvmsg(&raw.stream, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)
                .expect("recvmsg");
        for message in control.drain() {
            if let RecvAncillaryMessage::ScmRights(received) = message {
                fds.extend(received);
            }
        }
        assert!(received.bytes > 0, "the server closed the connection");
        bytes.extend_from_slice(&chunk[..received.bytes]);
    }
}

impl EngineWorker {
    /// Connects, attaches `instance` and registers it for engine-driven transfers; maps
    /// the pool.
    pub fn register(socket: &Path, instance: u64) -> EngineWorker {
        let mut raw = RawClient::connect_attached(socket, instance);
        let (reply, mut fds) = request_receiving_fds(
            &mut raw,
            "register_engine_driven",
            vec![instance.into(), "engine-model".into(), 1.into()],
        );
        let value = reply.result.expect("register_engine_driven succeeds");
        let outcome = field(&value, "outcome")
            .and_then(Value::as_str)
            .expect("outcome")
            .to_string();
        let (slot_bytes, num_slots) = (uint(&value, "slot_bytes"), uint(&value, "num_slots"));
        let index = uint(&value, "pool_fd_index") as usize;
        assert_eq!(fds.len(), 1, "exactly the pool's memfd rides on the reply");
        let fd = fds.swap_remove(index);
        let pool = SharedMapping::map(&fd, (slot_bytes * num_slots) as usize)
            .expect("mapping the L1 pool");
        EngineWorker {
            raw,
            instance,
            pool,
            slot_bytes,
            num_slots,
            outcome,
        }
    }

    /// A request naming this instance first; the raw reply.
    pub fn call(&mut self, op: &str, mut args: Vec<Value>) -> Reply {
        args.insert(0, self.instance.into());
        self.raw.request(op, args).expect("a reply")
    }

    pub fn prepare_store(&mut self, key: &[u8]) -> Option<Grant> {
        let value = self
            .call("prepare_store", vec![Value::Binary(key.to_vec())])
            .result
            .expect("prepare_store succeeds");
        grant(&value)
    }

    pub fn commit_store(&mut self, key: &[u8], nbytes: u64) -> bool {
        let value = self
            .call(
                "commit_store",
                vec![Value::Binary(key.to_vec()), nbytes.into()],
            )
            .result
            .expect("commit_store succeeds");
        value.as_bool().expect("a bool")
    }

    pub fn prepare_retrieve(&mut self, key: &[u8]) -> Option<Grant> {
        let value = self
            .call("prepare_retrieve", vec![Value::Binary(key.to_vec())])
            .result
            .expect("prepare_retrieve succeeds");
        grant(&value)
    }

    pub fn commit_retrieve(&mut self, key: &[u8]) -> bool {
        let value = self
            .call("commit_retrieve", vec![Value::Binary(key.to_vec())])
            .result
            .expect("commit_retrieve succeeds");
        value.as_bool().expect("a bool")
    }

    /// prepare_store, write `bytes` through the mapped pool, commit.
    pub fn store(&mut self, key: &[u8], bytes: &[u8]) {
        let grant = self.prepare_store(key).expect("a reservation");
        assert!(self.pool.write(grant.offset, bytes));
        assert!(self.commit_store(key, bytes.len() as u64));
    }

    /// prepare_retrieve, read through the mapped pool, commit_retrieve.
    pub fn load(&mut self, key: &[u8]) -> Option<Vec<u8>> {
        let grant = self.prepare_retrieve(key)?;
        let mut out = vec![0u8; grant.nbytes as usize];
        assert!(self.pool.read(grant.offset, &mut out));
        assert!(self.commit_retrieve(key));
        Some(out)
    }

    pub fn lookup(&mut self, key: &[u8]) -> u64 {
        let reply = self
            .raw
            .request(
                "lookup",
                vec![Value::Array(vec![Value::Binary(key.to_vec())])],
            )
            .expect("a reply");
        reply.result.expect("lookup").as_u64().expect("a uint")
    }

    pub fn ping(&mut self) -> bool {
        let value = self.call("ping", vec![]).result.expect("ping");
        value.as_bool().expect("a bool")
    }
}

fn grant(value: &Value) -> Option<Grant> {
    if value.is_nil() {
        return None;
    }
    Some(Grant {
        offset: uint(value, "offset"),
        nbytes: uint(value, "nbytes"),
    })
}

/// A rope parameter map for `register_blend`.
pub fn rope(rotary_dim: u64, max_positions: u64, base: f64) -> Value {
    Value::Map(vec![
        ("rotary_dim".into(), rotary_dim.into()),
        ("max_positions".into(), max_positions.into()),
        ("base".into(), Value::F64(base)),
    ])
}

/// `status.l1.<field>`.
pub fn l1(status: &serde_json::Value, field: &str) -> u64 {
    status["l1"][field]
        .as_u64()
        .unwrap_or_else(|| panic!("l1.{field} in {status}"))
}

// ------------------------------------------------------------------ helper process

const SOCKET: &str = "KVWARDEN_HELPER_SOCKET";
const INSTANCE: &str = "KVWARDEN_HELPER_INSTANCE";
const SCRIPT: &str = "KVWARDEN_HELPER_SCRIPT";

/// A helper process that registered, did its script, and waits to be killed.
pub struct Helper {
    pub child: Child,
}

impl Helper {
    /// Runs the helper test `helper_test` of this binary as a child process on
    /// `socket` for `instance`. `script` is a comma-separated list of steps:
    /// `engine` (register engine-driven), `kv` (register server-driven, no buffers),
    /// `reserve:KEY` (prepare_store, write half, never commit), `store:KEY`,
    /// `pin:KEY` (prepare_retrieve, never commit), `blend` (register_blend 64 × 1024).
    pub fn spawn(helper_test: &str, socket: &Path, instance: u64, script: &str) -> Helper {
        let mut child = Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", helper_test, "--nocapture", "--test-threads", "1"])
            .env(SOCKET, socket)
            .env(INSTANCE, instance.to_string())
            .env(SCRIPT, script)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning the helper");
        let stdout = child.stdout.take().expect("stdout");
        let (sender, receiver) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if line.contains("helper-ready") {
                    let _ = sender.send(());
                }
            }
        });
        if receiver.recv_timeout(PATIENCE).is_err() {
            let _ = child.kill();
            panic!("the helper process did not get ready ({script})");
        }
        Helper { child }
    }

    /// SIGKILL and reap.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The body of a helper test: does nothing unless run by [`Helper::spawn`].
pub fn run_helper_if_asked() {
    let (Some(socket), Some(instance), Some(script)) = (
        std::env::var_os(SOCKET),
        std::env::var(INSTANCE).ok(),
        std::env::var(SCRIPT).ok(),
    ) else {
        return;
    };
    let socket = std::path::PathBuf::from(socket);
    let instance: u64 = instance.parse().expect("instance");
    let mut engine: Option<EngineWorker> = None;
    let mut raw = RawClient::connect_attached(&socket, instance);
    for step in script.split(',') {
        let (verb, key) = step.split_once(':').unwrap_or((step, ""));
        let key = key.as_bytes();
        match verb {
            "engine" => engine = Some(EngineWorker::register(&socket, instance)),
            "kv" => {
                let reply = raw
                    .request(
                        "register_kv_cache",
                        vec![instance.into(), Value::Array(vec![]), "m".into(), 1.into()],
                    )
                    .expect("reply");
                reply.result.expect("register_kv_cache");
            }
            "reserve" => {
                let worker = engine.as_mut().expect("engine first");
                let grant = worker.prepare_store(key).expect("a reservation");
                assert!(worker.pool.write(grant.offset, b"half"));
            }
            "store" => engine.as_mut().expect("engine first").store(key, b"helper"),
            "pin" => {
                let worker = engine.as_mut().expect("engine first");
                worker.prepare_retrieve(key).expect("a committed key");
            }
            "blend" => {
                let reply = raw
                    .request(
                        "register_blend",
                        vec![instance.into(), rope(64, 1024, 10_000.0)],
                    )
                    .expect("reply");
                assert_eq!(reply.result.expect("register_blend"), Value::Boolean(true));
            }
            other => panic!("unknown helper step {other:?}"),
        }
    }
    println!("helper-ready");
    loop {
        std::thread::sleep(std::time::Duration::from_secs(60));
    }
}
