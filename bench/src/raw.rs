//! A blocking protocol connection for the benchmarks' control traffic: any op, any
//! instance id, fds as `SCM_RIGHTS`, and pipelining (send several, then receive).
//!
//! The worker client ([`kvwarden_client`]) binds one connection to one instance; the
//! benchmarks register thousands of instances, time single round trips and pipeline
//! copies, so they speak the protocol here directly.

use super::BenchError;
use crate::protocol::{PROTOCOL_VERSION, Reply, decode_reply, encode_request, split_frame};
use kvwarden_core::protocol::{ReplyValue, StatusReport};
use rmpv::Value;
use rustix::fd::{AsFd, BorrowedFd};
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use std::io::{IoSlice, Read, Write};
use std::mem::MaybeUninit;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// The largest reply accepted (a status map with 10,000 instances is about 2 MiB).
const MAX_REPLY_BYTES: usize = 256 << 20;
/// How long any reply may take.
const REPLY_BOUND: Duration = Duration::from_secs(60);

/// One connection to the server's Unix socket.
pub struct RawConnection {
    stream: UnixStream,
    next_id: u64,
    input: Vec<u8>,
    /// The instances this connection attached (protocol 2: a connection names only
    /// instances it proved).
    attached: std::collections::HashSet<u64>,
}

/// The secret a benchmark draws with `instance`: derived from the id, so that every
/// connection of a run (the control connection that registers, the fleet that pings)
/// proves the same one. A benchmark's instances need no protection from each other.
pub fn bench_secret(instance: u64) -> Vec<u8> {
    let mut secret = Vec::with_capacity(32);
    for round in 0..4u64 {
        secret.extend_from_slice(
            &(instance ^ round.wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_le_bytes(),
        );
    }
    secret
}

impl RawConnection {
    /// Connects to `socket` and says hello.
    pub fn connect(socket: &Path) -> Result<RawConnection, BenchError> {
        let mut connection = RawConnection::open(socket)?;
        connection.call(
            "hello",
            vec![PROTOCOL_VERSION.into(), "kvwarden-bench".into()],
        )?;
        Ok(connection)
    }

    /// Connects to `socket` and says hello with `sends_fds: false` (a client that only
    /// pings), checking that the server took the promise (its reply says `sends_fds:
    /// false`); the stream, for a caller that speaks on it itself.
    pub fn connect_without_fds(socket: &Path) -> Result<RawConnection, BenchError> {
        let mut connection = RawConnection::open(socket)?;
        let options = Value::Map(vec![("sends_fds".into(), false.into())]);
        let hello = connection.call(
            "hello",
            vec![PROTOCOL_VERSION.into(), "kvwarden-bench".into(), options],
        )?;
        let promised = hello.as_map().and_then(|map| {
            map.iter()
                .find(|(key, _)| key.as_str() == Some("sends_fds"))
                .and_then(|(_, sends)| sends.as_bool())
        });
        if promised != Some(false) {
            return Err(BenchError::Failed(format!(
                "the server did not take `sends_fds: false` in hello (its reply says \
                 {promised:?}); is it older than this bench?"
            )));
        }
        Ok(connection)
    }

    /// The stream, for a caller that speaks on it itself (nothing may be buffered).
    pub fn into_stream(self) -> UnixStream {
        self.stream
    }

    /// `attach [instance, bench_secret(instance)]`, once per connection.
    pub fn attach(&mut self, instance: u64) -> Result<(), BenchError> {
        if self.attached.contains(&instance) {
            return Ok(());
        }
        self.call(
            "attach",
            vec![instance.into(), Value::Binary(bench_secret(instance))],
        )?;
        self.attached.insert(instance);
        Ok(())
    }

    /// Attaches every id of `instances`, pipelined.
    pub fn attach_many(&mut self, instances: &[u64]) -> Result<(), BenchError> {
        let fresh: Vec<u64> = instances
            .iter()
            .copied()
            .filter(|instance| !self.attached.contains(instance))
            .collect();
        self.pipelined("attach", fresh.len(), |index| {
            (
                vec![
                    fresh[index].into(),
                    Value::Binary(bench_secret(fresh[index])),
                ],
                Vec::new(),
            )
        })?;
        self.attached.extend(fresh);
        Ok(())
    }

    /// Opens `socket` without saying hello (a worker's connection read with `recvmsg`).
    pub fn open(socket: &Path) -> Result<RawConnection, BenchError> {
        let stream = UnixStream::connect(socket).map_err(BenchError::io(format!(
            "connecting to the kvwarden server at {}",
            socket.display()
        )))?;
        stream
            .set_read_timeout(Some(REPLY_BOUND))
            .map_err(BenchError::io("setting a read timeout"))?;
        Ok(RawConnection {
            stream,
            next_id: 1,
            input: Vec::new(),
            attached: std::collections::HashSet::new(),
        })
    }

    /// The server's process id, as the kernel says (`SO_PEERCRED`).
    pub fn server_pid(&self) -> Result<i32, BenchError> {
        rustix::net::sockopt::socket_peercred(&self.stream)
            .map(|cred| cred.pid.as_raw_nonzero().get())
            .map_err(|e| BenchError::Io {
                what: "reading the server's pid (SO_PEERCRED)".into(),
                source: e.into(),
            })
    }

    /// Sends a request (with `fds` on its first byte) without waiting; returns its id.
    pub fn send(
        &mut self,
        op: &str,
        args: Vec<Value>,
        fds: &[BorrowedFd<'_>],
    ) -> Result<u64, BenchError> {
        let id = self.next_id;
        self.next_id += 1;
        let frame = encode_request(id, op, args);
        let mut sent = 0;
        if !fds.is_empty() {
            let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !control.push(SendAncillaryMessage::ScmRights(fds)) {
                return Err(BenchError::Failed(format!(
                    "{} fds do not fit one message",
                    fds.len()
                )));
            }
            sent = rustix::net::sendmsg(
                self.stream.as_fd(),
                &[IoSlice::new(&frame)],
                &mut control,
                SendFlags::NOSIGNAL,
            )
            .map_err(|e| BenchError::Io {
                what: format!("sending `{op}` with fds"),
                source: e.into(),
            })?;
        }
        self.stream
            .write_all(&frame[sent..])
            .map_err(BenchError::io(format!("sending `{op}`")))?;
        Ok(id)
    }

    /// Receives the next reply, whichever request it answers.
    pub fn receive(&mut self) -> Result<Reply, BenchError> {
        let mut chunk = [0u8; 64 * 1024];
        loop {
            if let Some((body, used)) = split_frame(&self.input, MAX_REPLY_BYTES)
                .map_err(|e| BenchError::Failed(format!("a bad reply frame: {e}")))?
            {
                let reply = decode_reply(body)
                    .map_err(|e| BenchError::Failed(format!("an undecodable reply: {e:?}")))?;
                self.input.drain(..used);
                return Ok(reply);
            }
            let n = self
                .stream
                .read(&mut chunk)
                .map_err(BenchError::io("reading a reply"))?;
            if n == 0 {
                return Err(BenchError::Failed(
                    "the server closed the connection".into(),
                ));
            }
            self.input.extend_from_slice(&chunk[..n]);
        }
    }

    /// One request, its reply's value (an error reply is an error naming the op).
    pub fn call(&mut self, op: &str, args: Vec<Value>) -> Result<Value, BenchError> {
        self.call_with_fds(op, args, &[])
    }

    /// One request carrying `fds`.
    pub fn call_with_fds(
        &mut self,
        op: &str,
        args: Vec<Value>,
        fds: &[BorrowedFd<'_>],
    ) -> Result<Value, BenchError> {
        let id = self.send(op, args, fds)?;
        loop {
            let reply = self.receive()?;
            if reply.id != id {
                continue;
            }
            return reply.result.map_err(|error| {
                BenchError::Failed(format!("the server refused `{op}`: {error}"))
            });
        }
    }

    /// `ping [instance]`: whether the server tracks it.
    pub fn ping(&mut self, instance: u64) -> Result<bool, BenchError> {
        self.attach(instance)?;
        match self.call("ping", vec![instance.into()])? {
            Value::Boolean(tracked) => Ok(tracked),
            other => Err(BenchError::Failed(format!(
                "`ping` answered {other}, expected a bool"
            ))),
        }
    }

    /// `status`, typed.
    pub fn status(&mut self) -> Result<StatusReport, BenchError> {
        let value = self.call("status", Vec::new())?;
        StatusReport::from_value(&value).ok_or_else(|| {
            BenchError::Failed(format!("`status` answered {value}, not this version's map"))
        })
    }

    /// Registers `instance` with `buffers` (memfd specs whose fds are `fds`) and
    /// returns the outcome (`created` / `refreshed`).
    pub fn register(
        &mut self,
        instance: u64,
        buffers: Vec<Value>,
        fds: &[BorrowedFd<'_>],
    ) -> Result<String, BenchError> {
        self.attach(instance)?;
        let args = vec![
            instance.into(),
            Value::Array(buffers),
            "kvwarden-bench".into(),
            1u64.into(),
        ];
        let value = self.call_with_fds("register_kv_cache", args, fds)?;
        outcome(&value)
    }

    /// The args of `register_kv_cache` (for pipelined registration).
    pub fn register_args(instance: u64, buffers: Vec<Value>) -> Vec<Value> {
        vec![
            instance.into(),
            Value::Array(buffers),
            "kvwarden-bench".into(),
            1u64.into(),
        ]
    }

    /// `unregister_kv_cache [instance]`.
    pub fn unregister(&mut self, instance: u64) -> Result<bool, BenchError> {
        self.attach(instance)?;
        Ok(self.call("unregister_kv_cache", vec![instance.into()])? == Value::Boolean(true))
    }

    /// Registers every id of `instances`, [`PIPELINE_DEPTH`] requests in flight, each
    /// with one memfd buffer `(fd, nbytes)` when given (the same memfd for all) or none.
    pub fn register_many(
        &mut self,
        instances: &[u64],
        buffer: Option<(BorrowedFd<'_>, u64)>,
    ) -> Result<(), BenchError> {
        let started = std::time::Instant::now();
        self.attach_many(instances)?;
        let (buffers, fds): (Vec<Value>, Vec<BorrowedFd<'_>>) = match buffer {
            Some((fd, nbytes)) => (vec![memfd_spec(0, nbytes)], vec![fd]),
            None => (Vec::new(), Vec::new()),
        };
        self.pipelined("register_kv_cache", instances.len(), |index| {
            (
                RawConnection::register_args(instances[index], buffers.clone()),
                fds.clone(),
            )
        })?;
        if instances.len() >= 1_000 {
            super::progress(&format!(
                "registered {} instances in {:.2} s",
                instances.len(),
                started.elapsed().as_secs_f64()
            ));
        }
        Ok(())
    }

    /// Unregisters every id of `instances`, pipelined.
    pub fn unregister_many(&mut self, instances: &[u64]) -> Result<(), BenchError> {
        self.attach_many(instances)?;
        self.pipelined("unregister_kv_cache", instances.len(), |index| {
            (vec![instances[index].into()], Vec::new())
        })
    }

    /// Sends `count` requests of `op` (args and fds from `request(i)`) with at most
    /// [`PIPELINE_DEPTH`] unanswered; fails on the first error reply.
    fn pipelined<'fd>(
        &mut self,
        op: &str,
        count: usize,
        request: impl Fn(usize) -> (Vec<Value>, Vec<BorrowedFd<'fd>>),
    ) -> Result<(), BenchError> {
        let (mut sent, mut answered) = (0, 0);
        while answered < count {
            while sent < count && sent - answered < PIPELINE_DEPTH {
                let (args, fds) = request(sent);
                self.send(op, args, &fds)?;
                sent += 1;
            }
            let reply = self.receive()?;
            answered += 1;
            if let Err(error) = reply.result {
                return Err(BenchError::Failed(format!(
                    "the server refused `{op}` (request {answered} of {count}): {error}"
                )));
            }
        }
        Ok(())
    }
}

/// Requests one control connection keeps in flight: below the server's per-connection
/// limit of 64 jobs.
pub const PIPELINE_DEPTH: usize = 32;

/// The `outcome` of a register reply.
pub fn outcome(value: &Value) -> Result<String, BenchError> {
    match value {
        Value::Map(map) => map
            .iter()
            .find(|(k, _)| k.as_str() == Some("outcome"))
            .and_then(|(_, v)| v.as_str())
            .map(str::to_owned),
        _ => None,
    }
    .ok_or_else(|| {
        BenchError::Failed(format!(
            "`register_kv_cache` answered {value}, expected {{\"outcome\": str}}"
        ))
    })
}

/// A memfd buffer spec for `register_kv_cache`.
pub fn memfd_spec(fd_index: u64, nbytes: u64) -> Value {
    crate::protocol::BufferSpec::Memfd { fd_index, nbytes }.to_value()
}

/// Distinct instance ids for a benchmark run: random high bits, so that two runs
/// against one server never collide, and never above 2^63 − 1.
pub fn instance_ids(count: usize) -> Vec<u64> {
    let base = kvwarden_core::InstanceId::generate().get() & 0x3fff_ffff_0000_0000;
    (0..count as u64).map(|i| base | (i + 1)).collect()
}
