//! A shell for the node tests (`node.rs`, `node_l2.rs`): it records every output, hands
//! the node time like the real loop, and answers nothing on its own: a test answers each
//! build, copy and L2 output by hand (or never, for one that hangs).

use super::secs;
use kvwarden_core::l2::{L2Counters, L2State};
use kvwarden_core::node::l1::SlotId;
use kvwarden_core::node::l2::{L2Delivery, L2Fetched, L2NodeConfig, L2ReadId, L2WriteId};
use kvwarden_core::node::{
    Built, ConnId, ContextId, CopyId, DeathNotice, Direction, Input, Node, NodeConfig, Note,
    Output, ProcessKey, Transport,
};
use kvwarden_core::node::{Job, L2Request};
use kvwarden_core::protocol::{BufferSpec, ErrorCode, Op, ProtocolError};
use kvwarden_core::{Config, FreeCause, InstanceId, Instant};
use rmpv::Value;
use std::time::Duration;

/// The uid of the process on connection 1, which owns what it registers.
pub const OWNER: u32 = 1000;
/// The size of an L1 slot.
pub const SLOT: u64 = 4096;

pub struct Harness {
    pub node: Node,
    pub now: Instant,
    pub out: Vec<Output>,
    next_request: u64,
    /// Connections and the instances the harness attached on them.
    attached: std::collections::BTreeSet<(ConnId, InstanceId)>,
    /// Attach automatically before the first request naming an instance (the default:
    /// a worker attaches on every connection). Off: a test sends `attach` itself.
    pub auto_attach: bool,
}

/// The token of the harness's TCP tenant (`tcp`).
pub const TCP_TOKEN: &[u8] = b"0123456789abcdef-tcp-token";

/// The node's key for `key` stored by `OWNER` (its tenant `uid-1000`'s prefix first).
pub fn node_key(key: &[u8]) -> Vec<u8> {
    kvwarden_core::node::trust::scoped_key(&format!("uid-{OWNER}"), key)
}

/// The key a worker named, from the node's key (its tenant's prefix `len | name`
/// stripped): what the tests compare against.
pub fn worker_key(node_key: &[u8]) -> Vec<u8> {
    let prefix = 1 + usize::from(node_key.first().copied().unwrap_or(0));
    node_key.get(prefix..).unwrap_or_default().to_vec()
}

/// The secret the harness's workers draw with `instance`.
pub fn secret_of(instance: InstanceId) -> Vec<u8> {
    instance.get().to_le_bytes().repeat(4)
}

impl Harness {
    /// A node of 4 slots, with L2 when `l2` is set; see [`Harness::with_slots`].
    pub fn new(l2: Option<L2NodeConfig>) -> Harness {
        Harness::with_slots(4, l2)
    }

    /// A node of `num_slots` slots at time zero (a 30 s reap timeout, a 5 s free
    /// watchdog, a 10 s shutdown drain), with connection 1 open: `OWNER`'s process 1.
    pub fn with_slots(num_slots: usize, l2: Option<L2NodeConfig>) -> Harness {
        Harness::with_limits(
            num_slots,
            l2,
            kvwarden_core::node::admission::ConnectionLimits::unbounded(),
        )
    }

    /// As [`Harness::with_slots`], with these connection limits.
    pub fn with_limits(
        num_slots: usize,
        l2: Option<L2NodeConfig>,
        connections: kvwarden_core::node::admission::ConnectionLimits,
    ) -> Harness {
        Harness::with_caps(
            num_slots,
            l2,
            connections,
            kvwarden_core::node::mapped::MappedLimits::unbounded(),
            kvwarden_core::node::jobs::UNBOUNDED,
        )
    }

    /// As [`Harness::with_slots`] without L2, handing at most `window` builds, copies
    /// and blends to the pool at once (the rest wait their tenant's turn).
    pub fn with_pool_window(num_slots: usize, window: usize) -> Harness {
        Harness::with_caps(
            num_slots,
            None,
            kvwarden_core::node::admission::ConnectionLimits::unbounded(),
            kvwarden_core::node::mapped::MappedLimits::unbounded(),
            window,
        )
    }

    /// As [`Harness::new`] without L2, with these caps on mapped memfd bytes.
    pub fn with_mapped(mapped: kvwarden_core::node::mapped::MappedLimits) -> Harness {
        Harness::with_caps(
            4,
            None,
            kvwarden_core::node::admission::ConnectionLimits::unbounded(),
            mapped,
            kvwarden_core::node::jobs::UNBOUNDED,
        )
    }

    fn with_caps(
        num_slots: usize,
        l2: Option<L2NodeConfig>,
        connections: kvwarden_core::node::admission::ConnectionLimits,
        mapped: kvwarden_core::node::mapped::MappedLimits,
        pool_window: usize,
    ) -> Harness {
        Harness::with_config(num_slots, l2, connections, mapped, pool_window, |_| {})
    }

    /// As [`Harness::with_slots`] without L2, with `adjust` applied to the node's
    /// configuration (a small tenant bound, subordinate uid ranges).
    pub fn adjusted(num_slots: usize, adjust: impl FnOnce(&mut NodeConfig)) -> Harness {
        Harness::with_config(
            num_slots,
            None,
            kvwarden_core::node::admission::ConnectionLimits::unbounded(),
            kvwarden_core::node::mapped::MappedLimits::unbounded(),
            kvwarden_core::node::jobs::UNBOUNDED,
            adjust,
        )
    }

    fn with_config(
        num_slots: usize,
        l2: Option<L2NodeConfig>,
        connections: kvwarden_core::node::admission::ConnectionLimits,
        mapped: kvwarden_core::node::mapped::MappedLimits,
        pool_window: usize,
        adjust: impl FnOnce(&mut NodeConfig),
    ) -> Harness {
        let mut config = NodeConfig {
            liveness: Config {
                reap_timeout: secs(30.0),
                registration_grace: secs(60.0),
                resolution: secs(1.0),
                stall_threshold: secs(5.0),
            },
            reap_timeout_floor: Duration::ZERO,
            num_slots,
            slot_bytes: SLOT,
            // The owner's tenant may register engine-driven (the server's own uid's
            // tenant is trusted with the pool); it acts on nothing it has not attached.
            server_uid: OWNER,
            trust: kvwarden_core::node::trust::TrustConfig {
                tenants: vec![kvwarden_core::node::trust::TenantSpec {
                    name: "tcp".into(),
                    uids: vec![],
                    tokens: vec![TCP_TOKEN.to_vec()],
                    quota_percent: None,
                    engine_driven: false,
                }],
                nonce_secret: [9; 32],
                ..Default::default()
            },
            boot_id: 7,
            server_name: "kvwarden test".into(),
            free_watchdog: secs(5.0),
            shutdown_drain: secs(10.0),
            cuda_devices: Err("no CUDA in tests".into()),
            connections,
            mapped,
            pool_window,
            kv_publish: Vec::new(),
            l2,
        };
        adjust(&mut config);
        let mut harness = Harness {
            node: Node::new(config, Instant::ZERO).unwrap(),
            now: Instant::ZERO,
            out: Vec::new(),
            next_request: 0,
            attached: Default::default(),
            auto_attach: true,
        };
        harness.connect(ConnId(1), Some(OWNER), Some(ProcessKey(1)));
        harness
    }

    pub fn input(&mut self, input: Input) {
        self.node.handle_input(self.now, input);
        self.drain();
    }

    pub fn drain(&mut self) {
        while let Some(output) = self.node.poll_output() {
            self.out.push(output);
        }
    }

    pub fn connect(&mut self, conn: ConnId, uid: Option<u32>, process: Option<ProcessKey>) {
        self.attached.retain(|(attached, _)| *attached != conn);
        self.input(Input::Connected {
            conn,
            uid,
            transport: Transport::Unix,
            process: process.map(|p| (p, DeathNotice::PidfdByPid)),
        });
    }

    /// Advances time as the loop does: `handle_timeout` whenever `poll_timeout` asks.
    pub fn run_until(&mut self, until: Instant) {
        while let Some(next) = self.node.poll_timeout().filter(|&t| t <= until) {
            self.now = next.max(self.now);
            self.node.handle_timeout(self.now);
            self.drain();
        }
        self.now = until;
        self.node.handle_timeout(self.now);
        self.drain();
    }

    /// [`Harness::run_until`] `duration` from now.
    pub fn run_for(&mut self, duration: Duration) {
        self.run_until(self.now + duration);
    }

    /// Sends `op` on `conn` with `fds` descriptors; returns its request id. With
    /// `auto_attach`, the first request naming an instance on a connection is preceded
    /// by its `attach` (whose reply is dropped: a refused one leaves the connection
    /// unattached, and the request is then refused `forbidden`).
    pub fn send_on(&mut self, conn: ConnId, op: Op, fds: usize) -> u64 {
        if let Some(instance) = op.instance()
            && self.auto_attach
            && !matches!(op, Op::Attach { .. })
            && self.attached.insert((conn, instance))
        {
            let attach = self.send_raw(
                conn,
                Op::Attach {
                    instance,
                    secret: secret_of(instance),
                },
                0,
            );
            let _ = self.reply(attach);
        }
        self.send_raw(conn, op, fds)
    }

    /// Sends `op` as it is, attaching nothing.
    pub fn send_raw(&mut self, conn: ConnId, op: Op, fds: usize) -> u64 {
        self.next_request += 1;
        let request_id = self.next_request;
        self.input(Input::Request {
            conn,
            request_id,
            op,
            fds,
        });
        request_id
    }

    /// Sends `op` on connection 1 with one descriptor; returns its request id.
    pub fn send(&mut self, op: Op) -> u64 {
        self.send_on(ConnId(1), op, 1)
    }

    /// The reply to `request_id`, taken out of the record, as the wire carries it
    /// (the shell encodes the node's answer with `Answer::to_value`).
    pub fn reply(&mut self, request_id: u64) -> Option<Result<Value, ProtocolError>> {
        let position = self.out.iter().position(
            |output| matches!(output, Output::Reply { request_id: r, .. } if *r == request_id),
        )?;
        match self.out.remove(position) {
            Output::Reply { result, .. } => Some(result.map(|answer| answer.to_value())),
            _ => None,
        }
    }

    /// The value `request_id` was answered with; panics unless it was answered so.
    pub fn answer(&mut self, request_id: u64) -> Value {
        match self.reply(request_id) {
            Some(Ok(value)) => value,
            other => panic!("request {request_id}: {other:?}"),
        }
    }

    /// The error `request_id` was refused with; panics unless it was refused.
    pub fn error(&mut self, request_id: u64) -> ErrorCode {
        match self.reply(request_id) {
            Some(Err(error)) => error.code,
            other => panic!("request {request_id}: expected an error, got {other:?}"),
        }
    }

    /// Sends `op` and returns the value it was answered with at once.
    pub fn ask(&mut self, op: Op) -> Value {
        let request = self.send(op);
        self.answer(request)
    }

    /// Over TCP connection `conn`, a client's `auth` with `token`: sends it, checks the
    /// server's proof, and returns the proof its `hello` carries (None: `auth` was
    /// refused).
    pub fn tcp_proof(&mut self, conn: ConnId, token: &[u8]) -> Option<Vec<u8>> {
        use kvwarden_core::protocol::tcp_auth::TcpKey;
        use kvwarden_core::protocol::{Challenge, ReplyValue};
        let key = TcpKey::from_token(token);
        let client = [conn.0 as u8; 32];
        let request = self.send_raw(
            conn,
            Op::Auth {
                id: key.id(),
                nonce: client,
            },
            0,
        );
        let challenge =
            Challenge::from_value(&self.reply(request)?.ok()?).expect("`auth` answers a challenge");
        assert!(
            key.check_server(&client, &challenge.nonce, &challenge.proof),
            "the server proves it holds the token"
        );
        Some(key.client_proof(&client, &challenge.nonce).to_vec())
    }

    /// Sends `op` and returns the error it was refused with at once.
    pub fn refuse(&mut self, op: Op) -> ErrorCode {
        let request = self.send(op);
        self.error(request)
    }

    /// Takes out of the record every output `pick` returns something for, in order.
    pub fn take<T>(&mut self, pick: impl Fn(&Output) -> Option<T>) -> Vec<T> {
        let mut taken = Vec::new();
        self.out.retain(|output| match pick(output) {
            Some(item) => {
                taken.push(item);
                false
            }
            None => true,
        });
        taken
    }

    pub fn builds(&mut self) -> Vec<ContextId> {
        self.take(|output| match output {
            Output::Job(Job::Build { context, .. }) => Some(*context),
            _ => None,
        })
    }

    pub fn frees(&mut self) -> Vec<(ContextId, FreeCause, &'static str)> {
        self.take(|output| match output {
            Output::Job(Job::Free {
                context,
                cause,
                label,
                ..
            }) => Some((*context, *cause, *label)),
            _ => None,
        })
    }

    pub fn copies(&mut self) -> Vec<(CopyId, Direction, u64)> {
        self.take(|output| match output {
            Output::Job(Job::Copy {
                copy,
                direction,
                nbytes,
                ..
            }) => Some((*copy, *direction, *nbytes)),
            _ => None,
        })
    }

    pub fn notes(&mut self) -> Vec<Note> {
        self.take(|output| match output {
            Output::Note(note) => Some(note.clone()),
            _ => None,
        })
    }

    pub fn l2_writes(&mut self) -> Vec<(L2WriteId, Vec<u8>, SlotId, u64)> {
        self.take(|output| match output {
            Output::L2(L2Request::Write {
                write,
                key,
                slot,
                nbytes,
            }) => Some((*write, worker_key(key), *slot, *nbytes)),
            _ => None,
        })
    }

    pub fn l2_gets(&mut self) -> Vec<(L2ReadId, Vec<u8>, SlotId)> {
        self.take(|output| match output {
            Output::L2(L2Request::Get {
                read, key, slot, ..
            }) => Some((*read, worker_key(key), *slot)),
            _ => None,
        })
    }

    pub fn l2_exists(&mut self) -> Vec<(L2ReadId, Vec<Vec<u8>>)> {
        self.take(|output| match output {
            Output::L2(L2Request::Exists { read, keys }) => {
                // The breaker's probe key is the node's own, in no tenant.
                let unscoped = |key: &Vec<u8>| match key.as_slice() {
                    kvwarden_core::node::l2::PROBE_KEY => key.clone(),
                    scoped => worker_key(scoped),
                };
                Some((*read, keys.iter().map(unscoped).collect()))
            }
            _ => None,
        })
    }

    /// How many L2 outputs the record holds.
    pub fn l2_outputs(&self) -> usize {
        self.out
            .iter()
            .filter(|output| {
                matches!(
                    output,
                    Output::L2(L2Request::Write { .. })
                        | Output::L2(L2Request::Get { .. })
                        | Output::L2(L2Request::Exists { .. })
                )
            })
            .count()
    }

    /// The one L2 read asked since the last look, taken out; panics unless exactly one.
    pub fn l2_get(&mut self) -> L2ReadId {
        let [(read, ..)] = self.l2_gets()[..] else {
            panic!("one L2 read")
        };
        read
    }

    /// Where each L2 read asked since the last look delivers (`None`: only its slot),
    /// taken out.
    pub fn l2_gets_delivering(&mut self) -> Vec<(L2ReadId, Option<L2Delivery>)> {
        self.take(|output| match output {
            Output::L2(L2Request::Get { read, deliver, .. }) => Some((*read, *deliver)),
            _ => None,
        })
    }

    /// The L2 reads given up (`L2Request::Cancel`) since the last look, taken out.
    pub fn l2_cancels(&mut self) -> Vec<L2ReadId> {
        self.take(|output| match output {
            Output::L2(L2Request::Cancel { read }) => Some(*read),
            _ => None,
        })
    }

    /// Answers every L2 read given up since the last look as the shell does when its
    /// cancel wins: `TimedOut`.
    pub fn l2_cancels_won(&mut self) {
        for read in self.l2_cancels() {
            self.l2_got(read, L2Fetched::TimedOut);
        }
    }

    /// Answers the L2 read `read` with `fetched`.
    pub fn l2_got(&mut self, read: L2ReadId, fetched: L2Fetched) {
        self.input(Input::L2Got { read, fetched });
    }

    /// Answers the copy `copy` with `result`.
    pub fn copy_done(&mut self, copy: CopyId, result: Result<u64, ProtocolError>) {
        self.input(Input::CopyDone { copy, result });
    }

    /// Builds the server-driven `context` (one 1 MiB buffer).
    pub fn build(&mut self, context: ContextId) {
        self.input(Input::BuildDone {
            context,
            result: Ok(Built::ServerDriven {
                buffer_lens: vec![1 << 20],
            }),
        });
    }

    /// Registers `instance` (server-driven, one 1 MiB buffer) and builds its context.
    pub fn registered(&mut self, instance: InstanceId) -> ContextId {
        let request = self.send(register(instance));
        let [context] = self.builds()[..] else {
            panic!("one build")
        };
        self.build(context);
        assert_eq!(outcome(&self.answer(request)), "created");
        context
    }

    /// Registers `instance` engine-driven and builds its context.
    pub fn engine_registered(&mut self, instance: InstanceId) {
        let request = self.send(Op::RegisterEngineDriven {
            instance,
            model_name: "m".into(),
            world_size: 1,
        });
        let [context] = self.builds()[..] else {
            panic!("one build")
        };
        self.input(Input::BuildDone {
            context,
            result: Ok(Built::EngineDriven),
        });
        let _ = self.answer(request);
    }

    /// A completed server-driven store of 100 bytes under `key`.
    pub fn stored(&mut self, instance: InstanceId, key: &[u8]) {
        let request = self.send(store(instance, key));
        let [(copy, Direction::ToL1, 100)] = self.copies()[..] else {
            panic!("one copy")
        };
        self.copy_done(copy, Ok(100));
        assert_eq!(self.answer(request), Value::from(true));
    }

    pub fn counters(&self) -> L2Counters {
        self.node.status().l2.expect("L2 is on").counters
    }

    pub fn state(&self) -> L2State {
        self.node.status().l2.expect("L2 is on").state
    }
}

/// REGISTER `instance` server-driven with one 1 MiB memfd buffer.
pub fn register(instance: InstanceId) -> Op {
    Op::RegisterKvCache {
        instance,
        buffers: vec![BufferSpec::Memfd {
            fd_index: 0,
            nbytes: 1 << 20,
        }],
        model_name: "m".into(),
        world_size: 1,
    }
}

/// Ping `instance`.
pub fn ping(instance: InstanceId) -> Op {
    Op::Ping {
        instance: Some(instance),
    }
}

/// Store 100 bytes from offset 0 of buffer 0 under `key`.
pub fn store(instance: InstanceId, key: &[u8]) -> Op {
    Op::Store {
        instance,
        key: key.to_vec(),
        buffer: 0,
        offset: 0,
        nbytes: 100,
    }
}

/// The `outcome` field of a REGISTER's answer ("created", "refreshed"), or "".
pub fn outcome(value: &Value) -> String {
    match value {
        Value::Map(map) => map
            .iter()
            .find(|(k, _)| k.as_str() == Some("outcome"))
            .and_then(|(_, v)| v.as_str())
            .unwrap_or("")
            .to_string(),
        _ => String::new(),
    }
}
