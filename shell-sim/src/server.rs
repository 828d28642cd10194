//! The server model: what the production shell does around the core's [`Liveness`].
//!
//! It reads requests, calls the core, builds contexts off the loop (a delay, sometimes
//! a failure) and reports them with `context_built` / `context_build_failed`, and
//! carries out every effect: a freed context closes its mappings, discards the
//! engine-driven reservations and releases the pins it owns (after any copy still
//! using it), and `DropBlendState` drops the instance's blend state. Its loop is the
//! one in the core's crate docs: input first, then `handle_timeout`, then every
//! effect, then sleep until `poll_timeout`. A paused server queues its input and reads
//! it all before judging any deadline on resume.
//!
//! Every core call and effect is reported to the [`Checker`] with the core's answer.

use crate::config::{InjectedBug, ServerSpec};
use crate::invariants::{Checker, ShellView};
use crate::message::{
    Envelope, PingAnswer, RegisterOutcome, Reply, ReplyEnvelope, Request, TransferAnswer,
};
use crate::oracle::Key;
use crate::time::{Nanos, duration, instant, nanos_of};
use kvwarden_core::{
    BuildTicket, Config, Effect, FreeCause, InstanceId, Liveness, Module, Registration,
};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// A context as the shell holds it: its id in the checker's ledger. Neither Clone nor
/// Copy, like the real mappings: it can only be freed by giving it away.
#[derive(Debug)]
pub struct Context {
    id: u64,
}

/// Whether the server process listens.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ServerState {
    /// Serving.
    Up,
    /// Dead; a new process starts later.
    Down,
    /// Shutting down cleanly: no new requests, builds and copies finishing.
    Draining,
    /// Gone for good.
    Stopped,
}

/// Something the loop reads.
#[derive(Debug)]
pub enum Input {
    /// A request from a worker.
    Request(Envelope),
    /// A build finished.
    BuildDone {
        /// The build serial.
        build: u64,
        /// Whether it failed.
        failed: bool,
    },
    /// A copy finished.
    CopyDone(u64),
    /// A pidfd reported an exit.
    ExitNotice(InstanceId),
}

/// One context handed back by the core, for the run's records.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FreeRecord {
    /// The instance.
    pub instance: InstanceId,
    /// The module.
    pub module: Module,
    /// Why.
    pub cause: FreeCause,
    /// The context id.
    pub context: u64,
}

/// What the server asks of the world after a step.
#[derive(Debug, Default)]
pub struct ServerOut {
    /// Replies to send.
    pub replies: Vec<ReplyEnvelope>,
    /// Builds started (serials): the world schedules their completion.
    pub builds: Vec<u64>,
    /// Copies started (context ids): the world schedules their completion.
    pub copies: Vec<u64>,
    /// Contexts the core handed back this step.
    pub frees: Vec<FreeRecord>,
    /// Entries reaped this step, context or not.
    pub reaped: u64,
}

struct PendingBuild {
    ticket: BuildTicket,
    /// Everyone waiting for the outcome: (slot, incarnation, round). REGISTERs that
    /// find the entry still building join here instead of hearing `refreshed` at once:
    /// should the build fail, a worker told `refreshed` would believe in a registration
    /// that does not exist, and with a second module still tracked its pings would keep
    /// answering true (found by the swarm, seed 2110).
    waiters: Vec<(usize, u32, u64)>,
}

/// Counters a scenario can assert on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Contexts built (handed to the core).
    pub contexts_built: u64,
    /// Builds that failed.
    pub builds_failed: u64,
    /// Engine-driven reservations discarded (never published) because their context went.
    pub reservations_discarded: u64,
    /// `bad_args` replies.
    pub bad_args: u64,
    /// Stalls the core reported.
    pub stalls: u64,
    /// Frees that waited for a copy.
    pub frees_deferred: u64,
}

/// The simulated server process.
pub struct Server {
    spec: ServerSpec,
    bug: Option<InjectedBug>,
    /// Bumped at each restart; connections to an older boot are broken.
    pub boot: u64,
    /// Whether it listens.
    pub state: ServerState,
    /// SIGSTOPped.
    pub paused: bool,
    liveness: Option<Liveness<Context>>,
    inbox: VecDeque<Input>,
    builds: BTreeMap<u64, PendingBuild>,
    building: BTreeMap<Key, u64>,
    build_serial: u64,
    /// Instances with CacheBlend rope state.
    pub blend: BTreeSet<InstanceId>,
    /// Pins plus reservations per context.
    pub holds: BTreeMap<u64, u32>,
    ops: BTreeMap<(InstanceId, u64), u64>,
    copies: BTreeMap<u64, u32>,
    deferred: BTreeMap<u64, Context>,
    known_keys: BTreeSet<Key>,
    /// Same-host processes the kernel says have exited (pidfd of a dead peer).
    pub exited_same_host: BTreeSet<InstanceId>,
    /// Counters.
    pub stats: ServerStats,
    /// The pending wake's instant.
    pub wake_at: Option<Nanos>,
    /// The pending wake's generation.
    pub wake_generation: u64,
    /// How far the wall clock is from the monotonic one (only the `wall_clock` bug
    /// reads it).
    pub wall_offset: i64,
}

impl Server {
    /// A server booted at `now`.
    pub fn new(spec: ServerSpec, bug: Option<InjectedBug>, now: Nanos) -> Result<Server, String> {
        let mut server = Server {
            spec,
            bug,
            boot: 0,
            state: ServerState::Down,
            paused: false,
            liveness: None,
            inbox: VecDeque::new(),
            builds: BTreeMap::new(),
            building: BTreeMap::new(),
            build_serial: 0,
            blend: BTreeSet::new(),
            holds: BTreeMap::new(),
            ops: BTreeMap::new(),
            copies: BTreeMap::new(),
            deferred: BTreeMap::new(),
            known_keys: BTreeSet::new(),
            exited_same_host: BTreeSet::new(),
            stats: ServerStats::default(),
            wake_at: None,
            wake_generation: 0,
            wall_offset: 0,
        };
        server.start(now)?;
        Ok(server)
    }

    /// The core configuration of this server.
    pub fn core_config(spec: &ServerSpec) -> Config {
        Config {
            reap_timeout: duration(spec.reap_timeout),
            registration_grace: duration(spec.registration_grace),
            resolution: duration(spec.resolution),
            stall_threshold: duration(spec.stall_threshold),
        }
    }

    /// A new process: empty registry, clock from `now`.
    pub fn start(&mut self, now: Nanos) -> Result<(), String> {
        let config = Self::core_config(&self.spec);
        let floor = if self.spec.allow_short_timeouts {
            std::time::Duration::ZERO
        } else {
            kvwarden_core::REAP_TIMEOUT_FLOOR
        };
        let liveness = Liveness::new_with_floor(config, instant(now), floor)
            .map_err(|error| error.to_string())?;
        self.liveness = Some(liveness);
        self.state = ServerState::Up;
        self.paused = false;
        Ok(())
    }

    /// The instant the loop must next call `handle_timeout`.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        if self.paused || !matches!(self.state, ServerState::Up | ServerState::Draining) {
            return None;
        }
        if self.bug == Some(InjectedBug::SkipHandleTimeout) {
            return None;
        }
        let late = if self.bug == Some(InjectedBug::LateWake) {
            2_400 * crate::time::MILLISECOND
        } else {
            0
        };
        self.liveness
            .as_ref()
            .and_then(|l| l.poll_timeout())
            .map(|at| at.as_nanos() + late)
    }

    /// The core's counters.
    pub fn status(&self) -> Option<kvwarden_core::Status> {
        self.liveness.as_ref().map(|l| l.status())
    }

    /// Whether the loop turns (up or draining, not paused).
    pub fn is_turning(&self) -> bool {
        !self.paused && matches!(self.state, ServerState::Up | ServerState::Draining)
    }

    /// One input: read it now, or queue it while paused.
    pub fn input(&mut self, now: Nanos, input: Input, checker: &mut Checker, out: &mut ServerOut) {
        match self.state {
            ServerState::Up => {}
            ServerState::Draining if !matches!(input, Input::Request(_)) => {}
            _ => return,
        }
        if self.paused {
            self.inbox.push_back(input);
            return;
        }
        self.read(now, input, checker, out);
        self.turn(now, checker, out);
    }

    /// The loop's own deadline.
    pub fn wake(&mut self, now: Nanos, checker: &mut Checker, out: &mut ServerOut) {
        if self.is_turning() {
            self.turn(now, checker, out);
        }
    }

    /// SIGSTOP.
    pub fn pause(&mut self, now: Nanos, checker: &mut Checker) {
        if self.state == ServerState::Up && !self.paused {
            self.paused = true;
            checker.server_paused(now);
        }
    }

    /// SIGCONT: every queued input is read before any deadline is judged.
    pub fn resume(&mut self, now: Nanos, checker: &mut Checker, out: &mut ServerOut) {
        if !self.paused {
            return;
        }
        self.paused = false;
        if self.bug == Some(InjectedBug::TimeoutBeforeInput) {
            self.turn(now, checker, out);
        }
        while let Some(input) = self.inbox.pop_front() {
            self.read(now, input, checker, out);
        }
        self.turn(now, checker, out);
    }

    /// The process dies: every context dies with it, connections break.
    pub fn crash(&mut self, now: Nanos, checker: &mut Checker) {
        self.state = ServerState::Down;
        self.paused = false;
        self.liveness = None;
        self.inbox.clear();
        self.builds.clear();
        self.building.clear();
        self.blend.clear();
        self.holds.clear();
        self.ops.clear();
        self.copies.clear();
        self.deferred.clear();
        self.known_keys.clear();
        self.boot += 1;
        self.wake_at = None;
        self.wake_generation += 1;
        checker.server_restarted(now);
    }

    /// SIGTERM: stop accepting, free every context exactly once, finish the builds (they
    /// come back cancelled), then stop.
    pub fn shut_down(&mut self, now: Nanos, checker: &mut Checker, out: &mut ServerOut) {
        if self.state != ServerState::Up {
            return;
        }
        self.paused = false;
        while let Some(input) = self.inbox.pop_front() {
            if !matches!(input, Input::Request(_)) {
                self.read(now, input, checker, out);
            }
        }
        self.state = ServerState::Draining;
        let self_at = self.core_now(now);
        let Some(liveness) = self.liveness.as_mut() else {
            return;
        };
        for key in std::mem::take(&mut self.known_keys) {
            let was = liveness.unregister(self_at, key.0, key.1);
            checker.unregister(now, key, was, false);
        }
        self.turn(now, checker, out);
        self.finish_draining();
    }

    fn finish_draining(&mut self) {
        if self.state == ServerState::Draining && self.builds.is_empty() && self.copies.is_empty() {
            self.state = ServerState::Stopped;
            self.liveness = None;
        }
    }

    fn read(&mut self, now: Nanos, input: Input, checker: &mut Checker, out: &mut ServerOut) {
        let at = self.core_now(now);
        let Some(liveness) = self.liveness.as_mut() else {
            return;
        };
        match input {
            Input::Request(envelope) => {
                let instance = envelope.instance;
                let answer = |reply| ReplyEnvelope {
                    slot: envelope.slot,
                    incarnation: envelope.incarnation,
                    boot: envelope.boot,
                    reply,
                };
                match envelope.request {
                    Request::Register { module, round } => {
                        let key = (instance, module);
                        match liveness.register(at, instance, module) {
                            Registration::Refreshed => {
                                checker.register(now, key, None);
                                let waits = self.bug != Some(InjectedBug::RefreshWhileBuilding);
                                let pending = self
                                    .building
                                    .get(&key)
                                    .filter(|_| waits)
                                    .and_then(|build| self.builds.get_mut(build));
                                match pending {
                                    Some(pending) => pending.waiters.push((
                                        envelope.slot,
                                        envelope.incarnation,
                                        round,
                                    )),
                                    None => out.replies.push(answer(Reply::Register {
                                        module,
                                        round,
                                        outcome: RegisterOutcome::Refreshed,
                                    })),
                                }
                            }
                            Registration::Build(ticket) => {
                                self.build_serial += 1;
                                let build = self.build_serial;
                                checker.register(now, key, Some(build));
                                self.known_keys.insert(key);
                                self.building.insert(key, build);
                                self.builds.insert(
                                    build,
                                    PendingBuild {
                                        ticket,
                                        waiters: vec![(envelope.slot, envelope.incarnation, round)],
                                    },
                                );
                                out.builds.push(build);
                            }
                        }
                        if self.exited_same_host.contains(&instance) {
                            // The pidfd of a peer that already exited reports it at once.
                            let held = liveness.process_exited(at, instance);
                            checker.process_exited(now, instance, held);
                        }
                    }
                    Request::Unregister { module } => {
                        let was = liveness.unregister(at, instance, module);
                        checker.unregister(now, (instance, module), was, envelope.exiting);
                        out.replies.push(answer(Reply::Unregister {
                            module,
                            was_registered: was,
                        }));
                    }
                    Request::Ping { seq } => {
                        let answer_value = if self.bug == Some(InjectedBug::IgnorePings) {
                            true
                        } else {
                            let tracked = liveness.ping(at, Some(instance));
                            checker.ping(now, instance, tracked);
                            tracked
                        };
                        let ping = if answer_value {
                            PingAnswer::Known
                        } else {
                            PingAnswer::Unknown
                        };
                        out.replies.push(answer(Reply::Ping { seq, answer: ping }));
                    }
                    Request::LegacyPing { seq } => {
                        // `ping []`: bad_args naming the mismatch; liveness untouched.
                        self.stats.bad_args += 1;
                        out.replies.push(answer(Reply::Ping {
                            seq,
                            answer: PingAnswer::BadArgs,
                        }));
                    }
                    Request::Transfer { module, op } => {
                        let key = (instance, module);
                        let result = liveness.transfer(at, instance, module).map(|c| c.id);
                        checker.transfer(now, key, result);
                        let reply = match result {
                            Ok(context) => {
                                if module == Module::EngineDriven {
                                    *self.holds.entry(context).or_default() += 1;
                                    self.ops.insert((instance, op), context);
                                } else if self.spec.copy_duration > 0 {
                                    *self.copies.entry(context).or_default() += 1;
                                    out.copies.push(context);
                                }
                                TransferAnswer::Done
                            }
                            Err(kvwarden_core::TransferError::NotRegistered) => {
                                TransferAnswer::NotRegistered
                            }
                            Err(kvwarden_core::TransferError::NotReady) => TransferAnswer::NotReady,
                        };
                        out.replies.push(answer(Reply::Transfer {
                            module,
                            op,
                            answer: reply,
                        }));
                    }
                    Request::Commit { op } => {
                        let key = (instance, Module::EngineDriven);
                        let result = liveness
                            .transfer(at, instance, Module::EngineDriven)
                            .map(|c| c.id);
                        checker.transfer(now, key, result);
                        let published = match self.ops.remove(&(instance, op)) {
                            Some(context) => {
                                if let Some(count) = self.holds.get_mut(&context) {
                                    *count -= 1;
                                    if *count == 0 {
                                        self.holds.remove(&context);
                                    }
                                }
                                true
                            }
                            None => false,
                        };
                        out.replies.push(answer(Reply::Commit { published }));
                    }
                    Request::RegisterBlend => {
                        let held = Module::ALL
                            .iter()
                            .any(|&m| liveness.entry(instance, m).is_some());
                        if held {
                            self.blend.insert(instance);
                        }
                        out.replies.push(answer(Reply::Blend { kept: held }));
                    }
                }
            }
            Input::BuildDone { build, failed } => {
                let Some(pending) = self.builds.remove(&build) else {
                    return;
                };
                let key = (pending.ticket.instance(), pending.ticket.module());
                if self.building.get(&key) == Some(&build) {
                    self.building.remove(&key);
                }
                let waiters = pending.waiters;
                let outcome = if failed {
                    self.stats.builds_failed += 1;
                    liveness.context_build_failed(at, pending.ticket);
                    checker.build_failed(now, key, build);
                    RegisterOutcome::Failed
                } else {
                    let id = checker.contexts.len() as u64;
                    checker.context_built(now, key, build, id);
                    self.stats.contexts_built += 1;
                    liveness.context_built(at, pending.ticket, Context { id });
                    let ready = liveness.entry(key.0, key.1).is_some_and(|e| !e.building);
                    if ready {
                        RegisterOutcome::Created
                    } else {
                        RegisterOutcome::Failed
                    }
                };
                for (slot, incarnation, round) in waiters {
                    out.replies.push(ReplyEnvelope {
                        slot,
                        incarnation,
                        boot: self.boot,
                        reply: Reply::Register {
                            module: key.1,
                            round,
                            outcome,
                        },
                    });
                }
            }
            Input::CopyDone(context) => {
                if let Some(count) = self.copies.get_mut(&context) {
                    *count -= 1;
                    if *count == 0 {
                        self.copies.remove(&context);
                        if let Some(deferred) = self.deferred.remove(&context) {
                            self.release(deferred, checker);
                        }
                    }
                }
            }
            Input::ExitNotice(instance) => {
                let held = liveness.process_exited(at, instance);
                checker.process_exited(now, instance, held);
            }
        }
    }

    /// The instant the core is told: the monotonic clock (the wall clock under the
    /// `wall_clock` bug).
    fn core_now(&self, now: Nanos) -> kvwarden_core::Instant {
        if self.bug == Some(InjectedBug::WallClock) {
            instant(now.saturating_add_signed(self.wall_offset))
        } else {
            instant(now)
        }
    }

    /// Time, then every effect, then the per-step checks.
    fn turn(&mut self, now: Nanos, checker: &mut Checker, out: &mut ServerOut) {
        let at = self.core_now(now);
        let Some(liveness) = self.liveness.as_mut() else {
            return;
        };
        let reaped_before = liveness.status().reaped_total;
        liveness.handle_timeout(at);
        checker.handle_timeout(now);
        let mut reaped_with_context = 0;
        while let Some(effect) = liveness.poll_effect() {
            match effect {
                Effect::FreeContext {
                    instance,
                    module,
                    context,
                    cause,
                } => {
                    if matches!(cause, FreeCause::Reaped { .. }) {
                        reaped_with_context += 1;
                    }
                    checker.free_requested((instance, module), context.id, cause);
                    out.frees.push(FreeRecord {
                        instance,
                        module,
                        cause,
                        context: context.id,
                    });
                    if self.copies.contains_key(&context.id) {
                        self.stats.frees_deferred += 1;
                        self.deferred.insert(context.id, context);
                    } else {
                        let id = context.id;
                        Self::release_parts(
                            &mut self.holds,
                            &mut self.ops,
                            &mut self.stats,
                            self.bug,
                            context,
                            checker,
                        );
                        if self.bug == Some(InjectedBug::DoubleFree) {
                            checker.released(id);
                        }
                    }
                }
                Effect::DropBlendState { instance }
                    if self.bug != Some(InjectedBug::KeepBlendState) =>
                {
                    self.blend.remove(&instance);
                }
                Effect::StallDetected { gap } => {
                    self.stats.stalls += 1;
                    checker.stall_reported(nanos_of(gap));
                }
                _ => {}
            }
        }
        let reaped = liveness.status().reaped_total - reaped_before;
        out.reaped += reaped;
        if reaped > reaped_with_context {
            checker.reaped_while_building(reaped - reaped_with_context, |key| {
                liveness.entry(key.0, key.1).is_some()
            });
        }
        checker.end_step(&ShellView {
            blend: &self.blend,
            holds: &self.holds,
        });
        if self.bug == Some(InjectedBug::Panic) && reaped > 0 {
            panic!("injected bug: the server model panics on its first reap");
        }
        self.finish_draining();
    }

    fn release(&mut self, context: Context, checker: &mut Checker) {
        Self::release_parts(
            &mut self.holds,
            &mut self.ops,
            &mut self.stats,
            self.bug,
            context,
            checker,
        );
        checker.end_step(&ShellView {
            blend: &self.blend,
            holds: &self.holds,
        });
    }

    /// Closes the mappings; an engine-driven context's reservations are discarded
    /// (never published: the slot may hold half-written data) and its pins released.
    fn release_parts(
        holds: &mut BTreeMap<u64, u32>,
        ops: &mut BTreeMap<(InstanceId, u64), u64>,
        stats: &mut ServerStats,
        bug: Option<InjectedBug>,
        context: Context,
        checker: &mut Checker,
    ) {
        if bug != Some(InjectedBug::KeepPins) {
            if let Some(count) = holds.remove(&context.id) {
                stats.reservations_discarded += u64::from(count);
                ops.retain(|_, owner| *owner != context.id);
            }
        }
        checker.released(context.id);
    }
}
