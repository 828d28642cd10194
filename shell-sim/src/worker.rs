//! A worker process: the client library's shell around the core's [`Heartbeat`].
//!
//! It registers (a *round*: one REGISTER per module, answered or timed out), pings on
//! the heartbeat's schedule, recovers when the heartbeat says so, transfers when it has
//! traffic (a `not_registered` answer makes the heartbeat recover at once, the clients'
//! one rule: `Heartbeat::on_not_registered`), and shuts down cleanly on request:
//! heartbeat stopped first, in-flight requests drained, then UNREGISTER, then exit.
//! Faults act on the process: a frozen one holds its replies until it thaws; a dead one
//! does nothing at all.
//!
//! It speaks the real protocol: every request is a [`kvwarden_core::protocol::Op`]
//! (a pre-liveness client's `ping []` travels as bytes through the server's real
//! decoder), and every reply is read from the real `Result<Value, ProtocolError>`.
//!
//! Who is who (protocol 2): the process draws a secret with its instance id and
//! attaches on every connection before anything else (the world's messages carry the
//! secret; the shell hands the node the `attach` when the connection opens). A request
//! answered `forbidden` for want of an attach makes it reconnect (a new connection,
//! attached again); its own `attach` refused `forbidden` (the id is bound to another
//! secret: squatted after a server restart) makes it draw a fresh id and secret
//! ([`Outbox::identity_refused`]) and register again under them (row 31).

use crate::config::{HeartbeatStart, WorkerSpec};
use crate::message::{Channel, HANDSHAKE_ID, Payload, body};
use crate::time::{Nanos, duration, instant};
use kvwarden_core::protocol::{ErrorCode, Op, ProtocolError, RopeSpec};
use kvwarden_core::{Heartbeat, HeartbeatAction, HeartbeatConfig, InstanceId, Module, PingReply};
use rmpv::Value;
use std::collections::VecDeque;

mod faults;
mod ops;

/// A hash map with a fixed seed (pruned with `retain`, never iterated into the trace).
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::FixedState>;

/// Bytes of the one memfd buffer a worker registers.
pub const BUFFER_BYTES: u64 = 1 << 20;
/// Bytes each store copies.
pub const STORE_BYTES: u64 = 4096;

/// What a request in flight was, to read its reply.
#[derive(Clone, Debug, PartialEq)]
enum Pending {
    Ping {
        seq: u64,
    },
    Register {
        module: Module,
        round: u64,
    },
    Unregister {
        module: Module,
    },
    Transfer {
        module: Module,
        prepared: Option<Vec<u8>>,
    },
    Commit,
    Blend,
}

/// The state of the process.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ProcessState {
    /// Running.
    Running,
    /// SIGSTOPped: timers and replies wait for the thaw.
    Frozen,
    /// Killed (or exited after a clean shutdown).
    Dead,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Purpose {
    /// The first registration after start.
    Initial,
    /// The heartbeat asked for a recovery.
    Recover,
    /// An operator asked for it (row 15), the worker's id changed (row 31), or a
    /// worker without a heartbeat was answered `not_registered`.
    Reregister,
}

#[derive(Clone, Debug)]
struct Round {
    serial: u64,
    purpose: Purpose,
    pending: Vec<Module>,
    ok: bool,
    deadline: Nanos,
}

#[derive(Clone, Debug)]
enum Shutdown {
    /// Heartbeat stopped; waiting until every request sent before has been answered or
    /// timed out, so that no REGISTER can land after the UNREGISTER.
    Draining { until: Nanos },
    /// UNREGISTER sent; waiting for the replies.
    Unregistering { pending: Vec<Module>, until: Nanos },
}

/// Counters a scenario can assert on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// Pings answered `bad_args` (each one logged loudly).
    pub bad_args_replies: u64,
    /// UNREGISTER answered `false`.
    pub unregister_false: u64,
    /// UNREGISTER answered `true`.
    pub unregister_true: u64,
    /// Transfers answered `not_registered`.
    pub not_registered_replies: u64,
    /// Registration rounds that succeeded after a recovery.
    pub recoveries_ok: u64,
    /// Pings sent.
    pub pings_sent: u64,
    /// Transfers sent.
    pub transfers_sent: u64,
    /// Replies `forbidden` (a request naming another uid's instance, row 23).
    pub forbidden_replies: u64,
    /// Raw byte frames sent (row 24).
    pub garbage_sent: u64,
    /// Fresh ids drawn because the process's own `attach` was refused (row 31).
    pub identity_changes: u64,
    /// Reconnections because a request was refused for want of an `attach`.
    pub reconnects: u64,
}

/// What a worker asks of the world after an input.
#[derive(Debug, Default)]
pub struct Outbox {
    /// Requests to send, in order.
    pub requests: Vec<(Channel, Payload)>,
    /// Raw frames to send on the raw connection (the world draws their bytes).
    pub garbage: u32,
    /// The process exited at the end of a clean shutdown.
    pub exited: bool,
    /// The server refused the process's own `attach`: the world draws it a fresh id and
    /// secret ([`Worker::change_identity`]).
    pub identity_refused: bool,
}

/// One worker process.
#[derive(Clone, Debug)]
pub struct Worker {
    /// Its slot.
    pub slot: usize,
    /// Which process of the slot this is.
    pub incarnation: u32,
    /// Its id, drawn at start-up (and again when its `attach` is refused).
    pub instance: InstanceId,
    /// The secret drawn with the id.
    pub secret: [u8; 32],
    /// Its connection's generation (see [`crate::message::Envelope::epoch`]).
    pub epoch: u32,
    registered_once: bool,
    /// Running, frozen or dead.
    pub process: ProcessState,
    spec: WorkerSpec,
    heartbeat: Heartbeat,
    starved: bool,
    ping_seq: u64,
    ping_sent_at: Option<Nanos>,
    round: Option<Round>,
    round_serial: u64,
    retry_initial_at: Option<Nanos>,
    next_traffic: Option<Nanos>,
    op_serial: u64,
    commits: VecDeque<(Nanos, Vec<u8>)>,
    last_stored: Option<Vec<u8>>,
    next_garbage: Option<Nanos>,
    shutdown: Option<Shutdown>,
    /// The latest instant a request sent so far can still be answered.
    last_request_deadline: Nanos,
    held_replies: Vec<(u64, Result<Value, ProtocolError>)>,
    request_serial: u64,
    /// Requests in flight: when sent, on which connection, what.
    pending: HashMap<u64, (Nanos, u32, Pending)>,
    /// Counters.
    pub stats: WorkerStats,
    /// The instant of the pending wake event, and its generation.
    pub wake_at: Option<Nanos>,
    /// Bumped each time a wake is scheduled; older wakes are stale.
    pub wake_generation: u64,
}

impl Worker {
    /// A process of `spec` with id `instance` and its secret, not yet started.
    pub fn new(
        slot: usize,
        incarnation: u32,
        instance: InstanceId,
        secret: [u8; 32],
        spec: WorkerSpec,
    ) -> Worker {
        let heartbeat = Heartbeat::new(HeartbeatConfig {
            interval: duration(spec.heartbeat_interval),
        });
        Worker {
            slot,
            incarnation,
            instance,
            secret,
            epoch: 0,
            registered_once: false,
            process: ProcessState::Running,
            spec,
            heartbeat,
            starved: false,
            ping_seq: 0,
            ping_sent_at: None,
            round: None,
            round_serial: 0,
            retry_initial_at: None,
            next_traffic: None,
            op_serial: 0,
            commits: VecDeque::new(),
            last_stored: None,
            next_garbage: None,
            shutdown: None,
            last_request_deadline: 0,
            held_replies: Vec::new(),
            request_serial: 0,
            pending: HashMap::default(),
            stats: WorkerStats::default(),
            wake_at: None,
            wake_generation: 0,
        }
    }

    /// The spec the process was started from.
    pub fn spec(&self) -> &WorkerSpec {
        &self.spec
    }

    /// Whether the heartbeat says its registrations can be trusted.
    pub fn is_healthy(&self) -> bool {
        self.heartbeat.is_healthy()
    }

    /// Whether the heartbeat runs.
    pub fn heartbeat_started(&self) -> bool {
        self.heartbeat.is_started() && !self.heartbeat.is_stopped()
    }

    /// Whether a clean shutdown was requested.
    pub fn is_shutting_down(&self) -> bool {
        self.shutdown.is_some()
    }

    /// Whether the process is alive (running or frozen) and not shutting down.
    pub fn is_serving(&self) -> bool {
        self.process != ProcessState::Dead && self.shutdown.is_none()
    }

    /// The process starts: its first registration round.
    pub fn start(&mut self, now: Nanos, out: &mut Outbox) {
        self.next_garbage = self.spec.garbage_every.map(|every| now + every);
        self.begin_round(now, Purpose::Initial, out);
    }

    /// The next instant this process wants to run, if any.
    pub fn next_wake(&self) -> Option<Nanos> {
        if self.process != ProcessState::Running {
            return None;
        }
        let heartbeat = if self.starved {
            None
        } else {
            self.heartbeat.poll_timeout().map(|at| at.as_nanos())
        };
        let shutdown = self.shutdown.as_ref().map(|shutdown| match shutdown {
            Shutdown::Draining { until } | Shutdown::Unregistering { until, .. } => *until,
        });
        [
            heartbeat,
            self.round.as_ref().map(|round| round.deadline),
            self.retry_initial_at,
            self.next_traffic,
            self.commits.front().map(|(at, _)| *at),
            self.next_garbage,
            shutdown,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Timers: do everything that is due at `now`.
    pub fn on_wake(&mut self, now: Nanos, out: &mut Outbox) {
        if self.process != ProcessState::Running {
            return;
        }
        if let Some(round) = &self.round
            && now >= round.deadline
        {
            self.finish_round(now, false, out);
        }
        if self.retry_initial_at.is_some_and(|at| now >= at) {
            self.retry_initial_at = None;
            self.begin_round(now, Purpose::Initial, out);
        }
        if !self.starved {
            if self
                .ping_sent_at
                .is_some_and(|sent| now >= sent + self.spec.heartbeat_interval)
            {
                self.ping_sent_at = None; // the heartbeat counts it as failed now
            }
            if let Some(action) = self.heartbeat.handle_timeout(instant(now)) {
                self.act(now, action, out);
            }
        }
        while let Some((at, _)) = self.commits.front() {
            if *at > now {
                break;
            }
            let Some((_, key)) = self.commits.pop_front() else {
                break;
            };
            let op = Op::CommitStore {
                instance: self.instance,
                key,
                nbytes: STORE_BYTES,
            };
            self.send(now, Pending::Commit, op, out);
        }
        if let (Some(at), Some(every)) = (self.next_garbage, self.spec.garbage_every)
            && now >= at
        {
            self.next_garbage = Some(now + every);
            self.stats.garbage_sent += 1;
            out.garbage += 1;
        }
        if self.next_traffic.is_some_and(|at| now >= at) {
            self.transfer_all(now, out);
        }
        self.advance_shutdown(now, out);
    }

    /// A reply arrives.
    pub fn on_reply(
        &mut self,
        now: Nanos,
        request_id: u64,
        result: Result<Value, ProtocolError>,
        out: &mut Outbox,
    ) {
        match self.process {
            ProcessState::Dead => {}
            ProcessState::Frozen => self.held_replies.push((request_id, result)),
            ProcessState::Running => self.handle_reply(now, request_id, result, out),
        }
    }

    fn handle_reply(
        &mut self,
        now: Nanos,
        request_id: u64,
        result: Result<Value, ProtocolError>,
        out: &mut Outbox,
    ) {
        let forbidden = matches!(&result, Err(error) if error.code == ErrorCode::Forbidden);
        if forbidden {
            self.stats.forbidden_replies += 1;
        }
        if request_id >= HANDSHAKE_ID {
            // Only a refusal of a connection's own `attach` comes back: the id is bound
            // to another secret. One of the current connection draws a fresh identity.
            if forbidden && request_id - HANDSHAKE_ID == u64::from(self.epoch) {
                out.identity_refused = true;
            }
            return;
        }
        let Some((_, epoch, pending)) = self.pending.remove(&request_id) else {
            return; // late, duplicated, or not ours to read (raw bytes)
        };
        if forbidden
            && epoch == self.epoch
            && let Err(error) = &result
            && error.message.contains("attach")
        {
            // The connection never attached this id (its attach was lost with a
            // refusal of it): reconnect, which attaches again.
            self.epoch += 1;
            self.stats.reconnects += 1;
        }
        match pending {
            Pending::Ping { seq } => self.ping_answered(now, seq, result, out),
            Pending::Register { module, round } => {
                self.registered(now, module, round, result.is_ok(), out)
            }
            Pending::Unregister { module } => {
                if result == Ok(Value::Boolean(true)) {
                    self.stats.unregister_true += 1;
                } else {
                    self.stats.unregister_false += 1;
                }
                if let Some(Shutdown::Unregistering { pending, .. }) = &mut self.shutdown {
                    pending.retain(|&m| m != module);
                }
                self.advance_shutdown(now, out);
            }
            Pending::Transfer { prepared, .. } => self.transferred(now, prepared, result, out),
            Pending::Commit | Pending::Blend => {}
        }
    }

    /// A ping's answer, unless a later ping's already counted: to the heartbeat.
    fn ping_answered(
        &mut self,
        now: Nanos,
        seq: u64,
        result: Result<Value, ProtocolError>,
        out: &mut Outbox,
    ) {
        if seq != self.ping_seq || self.ping_sent_at.is_none() {
            return; // late: that ping already counted
        }
        self.ping_sent_at = None;
        let reply = match result {
            Ok(Value::Boolean(true)) => PingReply::Known,
            Ok(Value::Boolean(false)) => PingReply::Unknown,
            Err(error) if error.code == ErrorCode::BadArgs => {
                // Loud: the client logs every bad_args at ERROR naming the
                // version mismatch; the simulator counts them.
                self.stats.bad_args_replies += 1;
                PingReply::Failed
            }
            _ => PingReply::Failed,
        };
        if let Some(action) = self.heartbeat.on_ping_reply(instant(now), reply) {
            self.act(now, action, out);
        }
    }

    /// A REGISTER of the current round answered: the round ends with its last.
    fn registered(&mut self, now: Nanos, module: Module, round: u64, ok: bool, out: &mut Outbox) {
        let Some(current) = self.round.as_mut() else {
            return;
        };
        if current.serial != round {
            return;
        }
        let Some(index) = current.pending.iter().position(|&m| m == module) else {
            return; // a duplicate
        };
        current.pending.swap_remove(index);
        if !ok {
            current.ok = false;
        }
        if current.pending.is_empty() {
            let ok = current.ok;
            self.finish_round(now, ok, out);
        }
    }

    /// A transfer answered: a reservation to commit later, or the recovery from
    /// `not_registered`.
    fn transferred(
        &mut self,
        now: Nanos,
        prepared: Option<Vec<u8>>,
        result: Result<Value, ProtocolError>,
        out: &mut Outbox,
    ) {
        match result {
            Ok(Value::Map(grant)) => {
                if let Some(key) = prepared
                    && self.shutdown.is_none()
                    && grant.iter().any(|(k, _)| k.as_str() == Some("slot"))
                {
                    self.commits.push_back((now + self.spec.commit_after, key));
                }
            }
            Err(error) if error.code == ErrorCode::NotRegistered => {
                self.stats.not_registered_replies += 1;
                if self.shutdown.is_none() {
                    if self.heartbeat.is_started() {
                        // The clients' one recovery rule: health clears and the
                        // heartbeat's recovery is due at once (`on_wake` runs it).
                        self.heartbeat.on_not_registered(instant(now));
                    } else if self.round.is_none() {
                        // A worker whose heartbeat never runs (`hb_start = Never`, a
                        // synthetic client: the real ones start it with the first
                        // transfer) re-registers by itself, so the node still sees
                        // registrations arrive without any ping.
                        self.begin_round(now, Purpose::Reregister, out);
                    }
                }
            }
            _ => {}
        }
    }

    fn act(&mut self, now: Nanos, action: HeartbeatAction, out: &mut Outbox) {
        match action {
            HeartbeatAction::SendPing => {
                self.ping_seq += 1;
                self.ping_sent_at = Some(now);
                self.stats.pings_sent += 1;
                let seq = self.ping_seq;
                if self.spec.legacy_ping {
                    // `ping []`: not an op this build can even express; the bytes go
                    // through the server's real decoder.
                    let id = self.track(now, Pending::Ping { seq });
                    out.requests
                        .push((Channel::Main, Payload::Bytes(body(id, "ping", Vec::new()))));
                } else {
                    let op = Op::Ping {
                        instance: Some(self.instance),
                    };
                    self.send(now, Pending::Ping { seq }, op, out);
                }
            }
            HeartbeatAction::Recover => self.begin_round(now, Purpose::Recover, out),
        }
    }

    fn begin_round(&mut self, now: Nanos, purpose: Purpose, out: &mut Outbox) {
        if self.shutdown.is_some() {
            if purpose == Purpose::Recover {
                // Unreachable after stop (the heartbeat returns nothing), kept for safety.
                self.heartbeat.on_recover_done(instant(now), false);
            }
            return;
        }
        self.round_serial += 1;
        let round = Round {
            serial: self.round_serial,
            purpose,
            pending: self.spec.modules.clone(),
            ok: true,
            deadline: now + self.spec.heartbeat_interval,
        };
        for module in self.spec.modules.clone() {
            let op = self.register_op(module);
            let pending = Pending::Register {
                module,
                round: round.serial,
            };
            self.send(now, pending, op, out);
        }
        // A recovery that replaces a running round still owes the heartbeat an answer:
        // the old round's replies are now ignored.
        self.round = Some(round);
    }

    fn finish_round(&mut self, now: Nanos, ok: bool, out: &mut Outbox) {
        let Some(round) = self.round.take() else {
            return;
        };
        match round.purpose {
            Purpose::Initial => {
                if !ok {
                    self.retry_initial_at = Some(now + self.spec.heartbeat_interval);
                    return;
                }
                self.registered_once = true;
                if self.spec.heartbeat_start == HeartbeatStart::OnRegister {
                    self.heartbeat.start(instant(now));
                }
                if let Some(every) = self.spec.traffic_every {
                    let first = now + self.spec.traffic_start_after.max(every);
                    self.next_traffic = Some(first);
                }
            }
            Purpose::Recover => {
                self.heartbeat.on_recover_done(instant(now), ok);
                if ok {
                    self.stats.recoveries_ok += 1;
                }
            }
            Purpose::Reregister => {}
        }
        if ok && self.spec.blend {
            let op = Op::RegisterBlend {
                instance: self.instance,
                rope: RopeSpec {
                    rotary_dim: 128,
                    max_positions: 4096,
                    base: 10_000.0,
                },
            };
            self.send(now, Pending::Blend, op, out);
        }
    }

    fn transfer_all(&mut self, now: Nanos, out: &mut Outbox) {
        let every = self
            .spec
            .traffic_every
            .unwrap_or(self.spec.heartbeat_interval);
        self.next_traffic = Some(now + every);
        if self.spec.heartbeat_start == HeartbeatStart::OnFirstTransfer {
            self.heartbeat.start(instant(now));
        }
        for module in self.spec.modules.clone() {
            self.op_serial += 1;
            self.stats.transfers_sent += 1;
            let op = self.transfer_op(module);
            let prepared = match &op {
                Op::PrepareStore { key, .. } => Some(key.clone()),
                _ => None,
            };
            self.send(now, Pending::Transfer { module, prepared }, op, out);
        }
    }

    fn track(&mut self, now: Nanos, pending: Pending) -> u64 {
        self.last_request_deadline = self
            .last_request_deadline
            .max(now + self.spec.heartbeat_interval);
        if self.pending.len() >= 256 {
            // Requests older than two timeouts were given up long ago.
            let horizon = now.saturating_sub(2 * self.spec.heartbeat_interval);
            self.pending.retain(|_, (sent, _, _)| *sent >= horizon);
        }
        self.request_serial += 1;
        let id = self.request_serial;
        self.pending.insert(id, (now, self.epoch, pending));
        id
    }

    fn send(&mut self, now: Nanos, pending: Pending, op: Op, out: &mut Outbox) {
        let fds = match op {
            Op::RegisterKvCache { .. } => 1,
            _ => 0,
        };
        let id = self.track(now, pending);
        out.requests
            .push((Channel::Main, Payload::Op { id, op, fds }));
    }

    /// The REGISTERs of every module, as this process sends them (the
    /// `register_after_unregister` bug sends them once more after the end).
    pub fn register_ops(&mut self, now: Nanos, out: &mut Outbox) {
        for module in self.spec.modules.clone() {
            let op = self.register_op(module);
            let pending = Pending::Register { module, round: 0 };
            self.send(now, pending, op, out);
        }
    }
}

/// The key of a worker's chunk number `serial`.
pub fn chunk_key(instance: InstanceId, serial: u64) -> Vec<u8> {
    let mut key = instance.get().to_le_bytes().to_vec();
    key.extend_from_slice(&serial.to_le_bytes());
    key
}

fn unregister_op(instance: InstanceId, module: Module) -> Op {
    match module {
        Module::ServerDriven => Op::UnregisterKvCache { instance },
        Module::EngineDriven => Op::UnregisterEngineDriven { instance },
    }
}
