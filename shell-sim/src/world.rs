//! One run: the agenda, the workers, the network and the server, stepped through
//! virtual time, with the invariants checked after every step.
//!
//! Every event is folded into a trace hash, so two runs of the same configuration can
//! be compared bit for bit (`--check-determinism`).

use crate::config::SimConfig;
use crate::event::{Agenda, Event};
use crate::invariants::Checker;
use crate::message::{Channel, Envelope, Payload, body};
use crate::network::{Network, Way};
use crate::rng::Rng;
use crate::server::{FreeRecord, Input, Server, ServerOut, ServerState};
use crate::time::{MILLISECOND, Nanos, as_seconds};
use crate::violation::Class;
use crate::worker::{Outbox, Worker};
use kvwarden_core::InstanceId;
use std::collections::{BTreeMap, BTreeSet};

/// A hash map with a fixed seed: lookups only, never iterated into the trace.
type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::FixedState>;

mod end;
mod faults;
mod report;
mod server_side;

pub use report::{RunReport, Snapshot, WorkerSnapshot, run_config};

/// More events than this at one virtual instant means something spins.
const SPIN_LIMIT: u64 = 1_000_000;

/// The world of one run.
pub struct World {
    cfg: SimConfig,
    rng: Rng,
    now: Nanos,
    agenda: Agenda,
    network: Network,
    workers: Vec<Option<Worker>>,
    server: Server,
    checker: Checker,
    trace: u64,
    timeline: Option<Vec<String>>,
    /// With `-v` and `KVWARDEN_SIM_TRACE_REQUESTS=1`: every request the server reads
    /// goes into the timeline too.
    trace_requests: bool,
    events: u64,
    frees: Vec<(Nanos, FreeRecord)>,
    reaps: Vec<(InstanceId, Nanos)>,
    used_ids: BTreeSet<u64>,
    /// Every id of each slot's processes: slot → incarnation → ids (a fresh one each
    /// time its `attach` was refused).
    instances: Vec<Vec<Vec<InstanceId>>>,
    /// The generator of the workers' secrets: its own, seeded from the run's seed, so
    /// that drawing them moves no other draw of the run.
    secrets: Rng,
    /// Instance ids an impostor read from the node's status (rows 30–31); kept across
    /// server restarts, as the impostor remembers them.
    seen_ids: BTreeSet<InstanceId>,
    /// Request ids of the adversaries' requests (above any client's own).
    adversary_serial: u64,
    /// TCP probes so far: each is a connection of its own.
    tcp_probes: u32,
    /// The server incarnation and how many `auth`s of the right token it has answered
    /// (its next challenge's count, [`crate::config::SIM_NONCE_SECRET`]).
    tcp_challenges: (u64, u64),
    /// The newest connection of each process (boot, slot, process, channel) whose
    /// message reached the socket, once any process reconnected (empty until then: every
    /// message is of a first connection).
    socket_epochs: HashMap<(u64, usize, u32, Channel), u32>,
    gone: BTreeMap<InstanceId, Nanos>,
    build_failure_rate: f64,
    free_hang_rate: f64,
    /// When the server was paused, and the jobs of its threads that would have finished
    /// meanwhile with the time they still needed: a SIGSTOP stops every thread.
    paused_at: Nanos,
    frozen_jobs: Vec<(Nanos, Event)>,
    max_link_delay: Nanos,
    snapshots: Vec<Option<Snapshot>>,
}

impl World {
    /// A world ready to run `cfg`; fails when the server configuration is invalid.
    pub fn new(cfg: SimConfig, checkpoints: Vec<Nanos>, verbose: bool) -> Result<World, String> {
        let server = Server::new(cfg.server.clone(), cfg.bug, 0)?;
        let spec = &cfg.server;
        let mut checker = Checker::new(
            0,
            spec.reap_timeout,
            spec.registration_grace,
            spec.resolution,
            spec.stall_threshold,
        );
        checker.set_trust(crate::config::SERVER_UID, spec.tcp_token.clone());
        let network = Network::new(cfg.workers.iter().map(|w| w.link.clone()));
        let mut max_link_delay = 0;
        for (slot, _) in cfg.workers.iter().enumerate() {
            max_link_delay = max_link_delay.max(network.max_delay(slot));
        }
        let mut agenda = Agenda::default();
        for (slot, worker) in cfg.workers.iter().enumerate() {
            agenda.push(worker.start_at, Event::Start(slot));
        }
        for (index, fault) in cfg.events.iter().enumerate() {
            agenda.push(fault.at, Event::Fault(index));
        }
        for (index, &at) in checkpoints.iter().enumerate() {
            agenda.push(at, Event::Checkpoint(index));
        }
        let slots = cfg.workers.len();
        Ok(World {
            rng: Rng::new(cfg.seed),
            now: 0,
            agenda,
            network,
            workers: vec![None; slots],
            server,
            checker,
            trace: 0xcbf2_9ce4_8422_2325 ^ cfg.seed,
            timeline: verbose.then(Vec::new),
            trace_requests: verbose && std::env::var_os("KVWARDEN_SIM_TRACE_REQUESTS").is_some(),
            events: 0,
            frees: Vec::new(),
            reaps: Vec::new(),
            used_ids: BTreeSet::new(),
            instances: vec![Vec::new(); slots],
            secrets: Rng::new(cfg.seed ^ 0x5ec2_e7a1_7ac4_0000),
            seen_ids: BTreeSet::new(),
            adversary_serial: 0,
            tcp_probes: 0,
            tcp_challenges: (0, 0),
            socket_epochs: HashMap::default(),
            gone: BTreeMap::new(),
            build_failure_rate: cfg.server.build_failure_rate,
            free_hang_rate: cfg.server.free_hang_rate,
            paused_at: 0,
            frozen_jobs: Vec::new(),
            max_link_delay,
            snapshots: vec![None; checkpoints.len()],
            cfg,
        })
    }

    /// Runs to the end (or the first violation) and reports.
    pub fn run(mut self) -> RunReport {
        self.schedule_server_wake();
        let mut same_instant = 0u64;
        while let Some(at) = self.agenda.peek_at() {
            if at > self.cfg.duration {
                break;
            }
            let Some((at, event)) = self.agenda.pop() else {
                break;
            };
            if at == self.now {
                same_instant += 1;
                if same_instant > SPIN_LIMIT {
                    self.checker.fail(
                        Class::Liveness,
                        "livelock",
                        format!(
                            "more than {SPIN_LIMIT} events at one instant: a loop asks to be \
                             woken in the past and spins without time passing"
                        ),
                    );
                    break;
                }
            } else {
                same_instant = 0;
            }
            self.now = at;
            self.events += 1;
            self.step(event);
            if self.checker.violation.is_some() {
                break;
            }
            if self.server.is_turning() && self.server.state == ServerState::Up {
                self.checker.check_overdue(self.now);
            }
            if self.checker.violation.is_some() {
                break;
            }
        }
        if self.checker.violation.is_none() {
            self.now = self.now.max(self.cfg.duration);
            self.check_end();
        }
        if let Some(violation) = &self.checker.violation {
            let line = format!("{violation}");
            self.note(line);
        }
        let last = self.snapshot();
        let checkpoints = std::mem::take(&mut self.snapshots)
            .into_iter()
            .map(|s| s.unwrap_or_else(|| last.clone()))
            .collect();
        let mut builds = BTreeMap::new();
        for record in &self.checker.contexts {
            *builds.entry(record.instance).or_insert(0u64) += 1;
        }
        RunReport {
            name: self.cfg.name.clone(),
            seed: self.cfg.seed,
            violation: self.checker.violation.clone(),
            trace_hash: self.trace,
            events: self.events,
            end: self.now,
            timeline: self.timeline.take().unwrap_or_default(),
            checkpoints,
            last,
            frees: std::mem::take(&mut self.frees),
            reaps: std::mem::take(&mut self.reaps),
            instances: std::mem::take(&mut self.instances),
            builds,
        }
    }

    fn mix(&mut self, value: u64) {
        self.trace = (self.trace ^ value)
            .wrapping_mul(0x0000_0100_0000_01b3)
            .rotate_left(5);
    }

    fn note(&mut self, line: String) {
        if let Some(timeline) = self.timeline.as_mut() {
            timeline.push(format!("{:>12.6}s  {line}", as_seconds(self.now)));
        }
    }

    fn verbose(&self) -> bool {
        self.timeline.is_some()
    }

    fn step(&mut self, event: Event) {
        let now = self.now;
        let Some(event) = self.unless_paused(event) else {
            return;
        };
        self.mix(now);
        match event {
            Event::Start(slot) => {
                self.mix(1);
                self.spawn(slot);
            }
            Event::ToServer(envelope) => {
                self.mix(2 ^ (envelope.slot as u64) << 8 ^ envelope.code() << 24);
                self.deliver_to_server(*envelope);
            }
            Event::ToWorker(envelope) => {
                self.mix(3 ^ (envelope.slot as u64) << 8);
                self.deliver_to_worker(*envelope);
            }
            Event::WorkerWake { slot, generation } => {
                let current = self.workers[slot]
                    .as_ref()
                    .is_some_and(|w| w.wake_generation == generation);
                if !current {
                    return;
                }
                self.mix(4 ^ (slot as u64) << 8);
                let Some(worker) = self.workers[slot].as_mut() else {
                    return;
                };
                worker.wake_at = None;
                let mut out = Outbox::default();
                let healthy = worker.is_healthy();
                worker.on_wake(now, &mut out);
                self.after_worker(slot, out, healthy);
            }
            Event::ServerWake { generation } => {
                if self.server.wake_generation != generation {
                    return;
                }
                self.mix(5);
                self.server.wake_at = None;
                let mut out = ServerOut::default();
                self.server.wake(now, &mut self.checker, &mut out);
                self.after_server(out);
            }
            event @ (Event::BuildDone { .. }
            | Event::CopyDone { .. }
            | Event::BlendDone { .. }
            | Event::FreeDone { .. }
            | Event::L2Done { .. }
            | Event::PoolDone { .. }
            | Event::Disconnect { .. }) => self.job_done(event),
            Event::ExitNotice { instance } => {
                self.mix(8 ^ instance.get());
                if matches!(self.server.state, ServerState::Up | ServerState::Draining) {
                    self.server_input(Input::ExitNotice(instance));
                }
            }
            Event::ServerUp => {
                if self.server.state == ServerState::Down {
                    self.mix(9);
                    self.start_server();
                }
            }
            Event::Fault(index) => {
                self.mix(10 ^ (index as u64) << 8);
                let action = self.cfg.events[index].action.clone();
                self.apply(action);
            }
            Event::Checkpoint(index) => {
                let snapshot = self.snapshot();
                self.snapshots[index] = Some(snapshot);
            }
        }
    }

    /// `event`, unless it is a pool job's and the server is paused: the pool threads of
    /// a stopped process are stopped too, so the job finishes as long after the resume
    /// as it still needed at the pause.
    fn unless_paused(&mut self, event: Event) -> Option<Event> {
        let pool_job = matches!(
            event,
            Event::BuildDone { .. }
                | Event::CopyDone { .. }
                | Event::BlendDone { .. }
                | Event::FreeDone { .. }
                | Event::L2Done { .. }
                | Event::PoolDone { .. }
        );
        if self.server.paused && pool_job {
            self.frozen_jobs.push((self.now - self.paused_at, event));
            return None;
        }
        Some(event)
    }

    /// A job of the server's pool (or a connection's close) reports back, unless it
    /// was the process before a restart's.
    fn job_done(&mut self, event: Event) {
        match event {
            Event::BuildDone {
                boot,
                build,
                failed,
            } => {
                if boot != self.server.boot {
                    return;
                }
                self.mix(6 ^ build << 8 ^ u64::from(failed) << 60);
                self.server_input(Input::BuildDone {
                    context: build,
                    failed,
                });
            }
            Event::CopyDone { boot, copy } => {
                if boot != self.server.boot {
                    return;
                }
                self.mix(7 ^ copy << 8);
                self.server_input(Input::CopyDone(copy));
            }
            Event::BlendDone { boot, blend } => {
                if boot != self.server.boot {
                    return;
                }
                self.mix(13 ^ blend << 8);
                self.server_input(Input::BlendDone(blend));
            }
            Event::FreeDone { boot, free } => {
                if boot != self.server.boot {
                    return;
                }
                self.mix(14 ^ free << 8);
                self.server_input(Input::FreeDone(free));
            }
            Event::L2Done { boot, job, fate } => {
                if boot != self.server.boot {
                    return;
                }
                self.mix(15);
                self.server_input(Input::L2Done { job, fate });
            }
            Event::PoolDone { boot, job } => {
                if boot != self.server.boot {
                    return; // the process that ran it is gone: nothing was written
                }
                self.mix(16);
                self.server_input(Input::PoolDone(job));
            }
            Event::Disconnect {
                boot,
                slot,
                incarnation,
            } => {
                if boot != self.server.boot {
                    return;
                }
                self.mix(15 ^ (slot as u64) << 8);
                self.server_input(Input::Closed { slot, incarnation });
            }
            _ => {}
        }
    }

    fn fresh_instance(&mut self) -> InstanceId {
        loop {
            let raw = self.rng.next_u64() & InstanceId::MAX;
            if self.used_ids.insert(raw) {
                return InstanceId::new(raw).expect("masked to 63 bits");
            }
        }
    }

    fn fresh_secret(&mut self) -> [u8; 32] {
        let mut secret = [0u8; 32];
        for chunk in secret.chunks_mut(8) {
            chunk.copy_from_slice(&self.secrets.next_u64().to_le_bytes());
        }
        secret
    }

    fn spawn(&mut self, slot: usize) {
        let instance = self.fresh_instance();
        let secret = self.fresh_secret();
        let incarnation = self.instances[slot].len() as u32;
        self.instances[slot].push(vec![instance]);
        let spec = self.cfg.workers[slot].clone();
        if self.verbose() {
            self.note(format!(
                "{}#{incarnation} starts as instance {instance}",
                spec.name
            ));
        }
        let mut worker = Worker::new(slot, incarnation, instance, secret, spec);
        let mut out = Outbox::default();
        worker.start(self.now, &mut out);
        let healthy = worker.is_healthy();
        self.workers[slot] = Some(worker);
        self.after_worker(slot, out, healthy);
    }

    /// A message of the process in `slot` as it is now, on `channel`.
    pub(crate) fn envelope_of(
        &self,
        slot: usize,
        channel: Channel,
        payload: Payload,
    ) -> Option<Envelope> {
        let worker = self.workers.get(slot)?.as_ref()?;
        Some(Envelope {
            slot,
            incarnation: worker.incarnation,
            instance: worker.instance,
            boot: self.server.boot,
            sent_at: self.now,
            exiting: worker.is_shutting_down(),
            channel,
            uid: worker.spec().uid,
            same_host: worker.spec().same_host,
            secret: Some(worker.secret),
            epoch: worker.epoch,
            tcp: false,
            payload,
        })
    }

    fn after_worker(&mut self, slot: usize, out: Outbox, healthy_before: bool) {
        let Some(worker) = self.workers[slot].as_ref() else {
            return;
        };
        let instance = worker.instance;
        let incarnation = worker.incarnation;
        let healthy = worker.is_healthy();
        let mut requests = out.requests;
        for _ in 0..out.garbage {
            let id = self.rng.next_u64() >> 1;
            requests.push((Channel::Raw, Payload::Bytes(self.garbage(id, instance))));
        }
        for (channel, payload) in requests {
            if !matches!(self.server.state, ServerState::Up | ServerState::Draining) {
                continue; // connection refused
            }
            if let Some(envelope) = self.envelope_of(slot, channel, payload) {
                self.send_request(envelope);
            }
        }
        if out.identity_refused {
            self.change_identity(slot);
        }
        if healthy != healthy_before && self.verbose() {
            let name = self.cfg.workers[slot].name.clone();
            self.note(format!(
                "{name}#{incarnation} turns {}",
                if healthy { "healthy" } else { "unhealthy" }
            ));
        }
        if out.exited {
            if self.cfg.bug == Some(crate::config::InjectedBug::RegisterAfterUnregister) {
                self.ghost_register(slot);
            }
            self.exited(slot);
        }
        self.schedule_worker_wake(slot);
    }

    pub(crate) fn send_request(&mut self, envelope: Envelope) {
        let slot = envelope.slot;
        if slot >= self.workers.len() {
            // A TCP probe's own line: local, in order, lossless.
            self.agenda.push(
                self.now + crate::time::MILLISECOND / 10,
                Event::ToServer(Box::new(envelope)),
            );
            return;
        }
        let arrivals = self
            .network
            .send(&mut self.rng, self.now, slot, Way::ToServer);
        match arrivals {
            [Some(first), Some(second)] => {
                self.agenda
                    .push(first, Event::ToServer(Box::new(envelope.clone())));
                self.agenda
                    .push(second, Event::ToServer(Box::new(envelope)));
            }
            [Some(first), None] => self.agenda.push(first, Event::ToServer(Box::new(envelope))),
            _ => {}
        }
    }

    /// Raw bytes for the real decoder (row 24): garbage, a truncated request, a
    /// request of the wrong shape, or a valid one.
    fn garbage(&mut self, id: u64, instance: InstanceId) -> Vec<u8> {
        use rmpv::Value;
        let valid = match self.rng.between(0, 3) {
            0 => body(id, "ping", vec![Value::from(instance.get())]),
            1 => body(
                id,
                "lookup",
                vec![Value::Array(vec![Value::Binary(vec![1, 2])])],
            ),
            2 => body(id, "status", Vec::new()),
            _ => body(id, "store", vec![Value::from("not an id"), Value::Nil]),
        };
        match self.rng.between(0, 3) {
            0 => {
                let len = self.rng.between(0, 64) as usize;
                (0..len).map(|_| self.rng.next_u64() as u8).collect()
            }
            1 => {
                let cut = self.rng.between(0, valid.len() as u64 - 1) as usize;
                valid[..cut].to_vec()
            }
            2 => {
                let mut bytes = valid;
                let at = self.rng.between(0, bytes.len() as u64 - 1) as usize;
                bytes[at] ^= self.rng.next_u64() as u8 | 1;
                bytes
            }
            _ => valid,
        }
    }

    /// The `register_after_unregister` bug: a REGISTER leaves after the UNREGISTER.
    fn ghost_register(&mut self, slot: usize) {
        let Some(worker) = self.workers[slot].as_mut() else {
            return;
        };
        let mut out = Outbox::default();
        worker.register_ops(self.now, &mut out);
        for (channel, payload) in out.requests {
            if let Some(mut envelope) = self.envelope_of(slot, channel, payload) {
                envelope.exiting = true;
                self.agenda
                    .push(self.now + 1, Event::ToServer(Box::new(envelope)));
            }
        }
    }

    /// The process's `attach` was refused (its id is bound to another secret): a fresh
    /// id and secret, never used before (row 31).
    fn change_identity(&mut self, slot: usize) {
        let instance = self.fresh_instance();
        let secret = self.fresh_secret();
        let Some(worker) = self.workers[slot].as_mut() else {
            return;
        };
        let old = worker.instance;
        let incarnation = worker.incarnation as usize;
        if let Some(ids) = self.instances[slot].get_mut(incarnation) {
            ids.push(instance);
        }
        let healthy = worker.is_healthy();
        let mut out = Outbox::default();
        worker.change_identity(self.now, instance, secret, &mut out);
        if self.verbose() {
            let name = self.cfg.workers[slot].name.clone();
            self.note(format!(
                "{name}#{incarnation}: its attach of instance {old} was refused (bound to \
                 another secret); it carries on as instance {instance}"
            ));
        }
        self.after_worker(slot, out, healthy);
    }

    fn exited(&mut self, slot: usize) {
        let Some(worker) = self.workers[slot].as_ref() else {
            return;
        };
        let instance = worker.instance;
        let same_host = worker.spec().same_host;
        let incarnation = worker.incarnation;
        self.gone.insert(instance, self.now);
        // Its sockets close once what it sent is through (never a proof of death).
        let at = self.now + self.network.max_delay(slot) + MILLISECOND;
        let boot = self.server.boot;
        self.agenda.push(
            at,
            Event::Disconnect {
                boot,
                slot,
                incarnation,
            },
        );
        if same_host {
            self.server.exited_same_host.insert(instance);
            let at = self.now + self.cfg.server.exit_notice_delay;
            self.agenda.push(at, Event::ExitNotice { instance });
        }
        if self.verbose() {
            let name = self.cfg.workers[slot].name.clone();
            self.note(format!(
                "{name} (instance {instance}) exits (same host: {same_host})"
            ));
        }
    }

    fn schedule_worker_wake(&mut self, slot: usize) {
        let Some(worker) = self.workers[slot].as_mut() else {
            return;
        };
        match worker.next_wake() {
            None => {
                if worker.wake_at.is_some() {
                    worker.wake_at = None;
                    worker.wake_generation += 1;
                }
            }
            Some(at) => {
                if worker.wake_at.is_none_or(|pending| at < pending) {
                    worker.wake_generation += 1;
                    worker.wake_at = Some(at);
                    let generation = worker.wake_generation;
                    self.agenda
                        .push(at.max(self.now), Event::WorkerWake { slot, generation });
                }
            }
        }
    }

    fn schedule_server_wake(&mut self) {
        match self.server.poll_timeout() {
            None => {
                self.server.wake_at = None;
                self.server.wake_generation += 1;
            }
            Some(at) => {
                if self.server.wake_at.is_none_or(|pending| at < pending) {
                    self.server.wake_generation += 1;
                    self.server.wake_at = Some(at);
                    let generation = self.server.wake_generation;
                    self.agenda
                        .push(at.max(self.now), Event::ServerWake { generation });
                }
            }
        }
    }
}
