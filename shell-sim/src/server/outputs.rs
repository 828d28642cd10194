//! The node's outputs, each carried out by the simulated shell.

use super::{Call, FreeRecord, Server, ServerOut, ServerState, Step};
use crate::config::InjectedBug;
use crate::invariants::{Checker, ShellView};
use crate::message::{HANDSHAKE_ID, ReplyEnvelope};
use crate::pool::{Holds, PoolJob};
use crate::time::{Nanos, as_seconds, nanos_of};
use kvwarden_core::node::{BlendChange, Job, PeerAction};
use kvwarden_core::node::{
    ConnId, CopyId, Direction, Input as NodeInput, Note, Output, ProcessKey,
};
use kvwarden_core::node::{L2Link, ShellFigures};
use kvwarden_core::protocol::status::{GpuStatus, LimitsStatus};
use kvwarden_core::protocol::{
    Answer, BufferSpec, ErrorCode, ProtocolError, ReplyValue, StatusReport,
};
use kvwarden_core::{InstanceId, Module};
use rmpv::Value;

impl Server {
    /// Carries out one output of the node's call `call`.
    pub(super) fn carry_out(
        &mut self,
        now: Nanos,
        output: Output,
        call: &Call,
        checker: &mut Checker,
        out: &mut ServerOut,
        step: &mut Step,
    ) {
        match output {
            Output::Reply {
                conn,
                request_id,
                result,
                ..
            } => self.answer(conn, request_id, result, checker, out),
            Output::ReplyStatus { conn, request_id } => {
                let value = self.status_reply(now, checker);
                self.reply(conn, request_id, Ok(value), out);
            }
            Output::Job(job) => self.on_job(now, job, call, checker, out, step),
            Output::Blend(change) => self.on_blend(change, checker),
            Output::Peer(action) => self.on_peer(action, step),
            Output::L2(request) => self.on_l2(request, call, checker, out),
            Output::Note(note) => self.on_note(now, note, call, checker, step),
            Output::Stopped { .. } => {
                self.state = ServerState::Stopped;
                checker.stopped();
            }
            // The simulated server configures no node-scoped stream (`kv_publish`
            // is empty): the node publishes for none.
            Output::Publish { stream, .. } => checker.fail(
                crate::violation::Class::Safety,
                "unconfigured_stream",
                format!("the node published on stream {stream}, which nobody configured"),
            ),
        }
    }

    /// The `status` reply, as the production shell builds it but with the simulated
    /// shell's figures; read back as a client reads it, and held to the node's registry.
    fn status_reply(&self, now: Nanos, checker: &mut Checker) -> Value {
        let Some(node) = self.node.as_ref() else {
            return Value::Nil; // no node, no request to answer
        };
        let shell = ShellFigures {
            server: format!("kvwarden-sim {}", env!("CARGO_PKG_VERSION")),
            uptime_seconds: as_seconds(now),
            gpu: GpuStatus::Unavailable {
                available: false,
                reason: "simulated: no GPU".into(),
            },
            limits: LimitsStatus {
                open_files_soft: 0,
                open_files_hard: 0,
                connection_capacity: 0,
                max_connections: 0,
                closes_pending: 0,
            },
            pool: "anonymous",
            cold_reason: None,
            l2_link: Some(L2Link {
                nodes: vec!["simulated".into()],
                mode: Some("cluster"),
                ..L2Link::default()
            }),
        };
        let report = node.status_report(self.core_now(now), shell, &|_| None);
        let value = report.to_value();
        let read = StatusReport::from_value(&value);
        let tracked = node.tracked();
        let listed = report.instances.len() + report.instances_omitted;
        if read.as_ref() != Some(&report)
            || report.worker_liveness.tracked_instances != tracked
            || listed != tracked
        {
            checker.fail(
                crate::violation::Class::Internal,
                "status_reply",
                format!(
                    "status says {} tracked and lists {listed}, the node tracks {tracked}; \
                     read back whole: {}",
                    report.worker_liveness.tracked_instances,
                    read.as_ref() == Some(&report)
                ),
            );
        }
        value
    }

    /// A job the node started: the simulated pool runs it later (its input comes
    /// through the agenda); the checker learns what it holds meanwhile.
    pub(super) fn on_job(
        &mut self,
        now: Nanos,
        job: Job,
        call: &Call,
        checker: &mut Checker,
        out: &mut ServerOut,
        step: &mut Step,
    ) {
        match job {
            Job::Build {
                context,
                instance,
                module,
                buffers,
                ..
            } => {
                let lens = buffers.iter().map(BufferSpec::nbytes).collect();
                self.builds.insert(context, ((instance, module), lens));
                out.builds.push(context.0);
            }
            job @ Job::Copy { .. } => self.on_copy(job, call, checker, out),
            Job::Blend { blend, .. } => out.blends.push(blend.0),
            job @ Job::Free { .. } => self.on_free(now, job, call, checker, out, step),
            Job::Seal { slot, key, len } if self.pool.is_some() => {
                if let Call::Request {
                    publish: (keys, true),
                    ..
                } = call
                    && keys.contains(&key)
                    && let Some(pool) = self.pool.as_mut()
                {
                    // An engine-driven commit: the engine wrote the value through its
                    // mapping before it committed.
                    pool.write_started(slot, self.boot);
                    pool.write_done(slot, Some(key.clone()));
                }
                self.sealing += 1;
                out.pool_jobs.push(PoolJob::Seal { slot, key, len });
            }
            Job::Scan { first, count } if self.pool.is_some() => {
                let found = self
                    .pool
                    .as_ref()
                    .map_or_else(Vec::new, |pool| pool.scan(first, count));
                out.pool_jobs.push(PoolJob::Scan { first, found });
            }
            // Without `pool_file` the simulated pool is anonymous (`persist_pool` is never
            // called): a seal or a scan means the node persisted a pool nobody asked it to.
            Job::Seal { slot, .. } | Job::Scan { first: slot, .. } => checker.fail(
                crate::violation::Class::Safety,
                "unasked_persistence",
                format!("the node sealed or scanned slot {slot} of an anonymous pool"),
            ),
        }
    }

    /// A copy starts: on the pool file too, and counted against its context.
    fn on_copy(&mut self, job: Job, call: &Call, checker: &mut Checker, out: &mut ServerOut) {
        let Job::Copy {
            copy,
            context,
            direction,
            offset,
            slot,
            ..
        } = job
        else {
            return;
        };
        if self.pool.is_some() {
            self.pool_copy(copy, direction, slot, offset, call, checker);
        }
        if direction == Direction::ToL1
            && let Call::Request {
                publish: (keys, false),
                ..
            } = call
            && let Some(key) = keys.get((offset / crate::worker::STORE_BYTES) as usize)
        {
            self.store_copies.insert(copy.0, key.clone());
        }
        if let Some(&id) = self.ledger.get(&context) {
            self.copies.insert(copy, id);
            checker.copy_started(id);
        }
        out.copies.push(copy.0);
    }

    /// A context is given back for its free: checked against the ledger, and recorded.
    fn on_free(
        &mut self,
        now: Nanos,
        job: Job,
        call: &Call,
        checker: &mut Checker,
        out: &mut ServerOut,
        step: &mut Step,
    ) {
        let Job::Free {
            free,
            context,
            instance,
            module,
            cause,
            ..
        } = job
        else {
            return;
        };
        let Some(&id) = self.ledger.get(&context) else {
            checker.fail(
                crate::violation::Class::Safety,
                "double_free",
                format!("the node freed context {context:?}, which it never built"),
            );
            return;
        };
        checker.free_requested((instance, module), id, cause);
        if matches!(call, Call::CopyDone) {
            self.stats.frees_deferred += 1;
        }
        if module == Module::EngineDriven {
            step.engine_freed = true;
            if let Some(keys) = self.reserved.remove(&instance) {
                self.reserved_total -= keys.len();
            }
        }
        self.frees.insert(free, id);
        self.free_runs
            .insert(free, ((instance, module), now, self.paused_total));
        out.free_jobs.push(free.0);
        out.frees.push(FreeRecord {
            instance,
            module,
            cause,
            context: id,
        });
        step.freed.push(((instance, module), cause));
    }

    /// A copy on the pool file: one into L1 writes its slot (torn until it ends); one
    /// out of L1 must read the whole value of the key it is read for.
    pub(super) fn pool_copy(
        &mut self,
        copy: CopyId,
        direction: Direction,
        slot: usize,
        offset: u64,
        call: &Call,
        checker: &mut Checker,
    ) {
        let Some(pool) = self.pool.as_mut() else {
            return;
        };
        if direction == Direction::ToL1 {
            pool.write_started(slot, self.boot);
            self.pool_writes.insert(copy.0, slot);
            return;
        }
        let wanted = match call {
            Call::Request {
                conn, request_id, ..
            } => self
                .tenant_reads
                .get(&(conn.0, *request_id))
                .and_then(|(_, read)| {
                    let key = read
                        .keys
                        .get((offset / crate::worker::STORE_BYTES) as usize)?;
                    let mut scoped = read.prefix.clone();
                    scoped.extend_from_slice(key);
                    Some(scoped)
                }),
            _ => None,
        };
        let fault = match (pool.holds(slot), wanted) {
            (Holds::Torn | Holds::Blank, _) => Some(("served_torn", None)),
            (Holds::Whole(held), Some(wanted)) if *held != wanted => {
                Some(("served_other_value", Some((held.clone(), wanted))))
            }
            _ => None,
        };
        if let Some((invariant, keys)) = fault {
            let detail = match keys {
                Some((held, wanted)) => format!(
                    "the node served key {} from L1 slot {slot}, which holds the value of key \
                     {} (row 71: a value is served only under its own key)",
                    crate::invariants::hex(&wanted),
                    crate::invariants::hex(&held)
                ),
                None => format!(
                    "the node served L1 slot {slot}, whose bytes no write completed \
                     ({}: row 72, a torn value is never served)",
                    pool.holds(slot)
                ),
            };
            checker.fail(crate::violation::Class::Safety, invariant, detail);
        }
        if pool.written_in(slot) < self.boot {
            self.stats.adopted_served += 1;
        }
    }

    /// A seal or scan of the pool file ends: the seal is written over what the slot
    /// holds now; the scan's findings (read when it started) go to the node, and every
    /// slot the node then holds committed must hold that key's value.
    pub(super) fn pool_done(
        &mut self,
        now: Nanos,
        job: PoolJob,
        checker: &mut Checker,
        out: &mut ServerOut,
    ) {
        let Some(pool) = self.pool.as_mut() else {
            return;
        };
        match job {
            PoolJob::Seal { slot, key, len } => {
                self.sealing = self.sealing.saturating_sub(1);
                if let Some(held) = pool.seal(slot, key.clone(), len) {
                    checker.fail(
                        crate::violation::Class::Safety,
                        "sealed_other_bytes",
                        format!(
                            "the node had L1 slot {slot} sealed as key {}, but the slot holds \
                             {held}: it was not kept until its seal was written (row 71)",
                            crate::invariants::hex(&key)
                        ),
                    );
                }
                let input = NodeInput::Sealed {
                    slot,
                    written: true,
                };
                self.call(now, Some(input), Call::Other, checker, out);
            }
            PoolJob::Scan { first, found } => {
                let count = found.len();
                let input = NodeInput::Scanned { first, found };
                self.call(now, Some(input), Call::Other, checker, out);
                let (Some(node), Some(pool)) = (self.node.as_ref(), self.pool.as_ref()) else {
                    return;
                };
                for slot in first..first + count {
                    let Some(key) = node.l1_committed_key(slot) else {
                        continue;
                    };
                    match pool.holds(slot) {
                        Holds::Whole(held) if held == key => {}
                        Holds::Unnamed => {}
                        held => checker.fail(
                            crate::violation::Class::Safety,
                            "adopted_other_bytes",
                            format!(
                                "after the scan of L1 slot {slot} the node holds key {} there, but the \
                                 slot holds {held} (row 71: only a value whose seal still covers its \
                                 bytes is adopted)",
                                crate::invariants::hex(key)
                            ),
                        ),
                    }
                }
            }
        }
    }

    pub(super) fn on_blend(&mut self, change: BlendChange, checker: &mut Checker) {
        match change {
            BlendChange::Keep { instance, .. } => {
                self.blend.insert(instance);
                checker.touch_instance(instance);
            }
            BlendChange::Discard { .. } => {}
            BlendChange::Drop { instance } => {
                self.blend.remove(&instance);
            }
        }
    }

    pub(super) fn on_peer(&mut self, action: PeerAction, step: &mut Step) {
        match action {
            PeerAction::Watch { process, .. } => {
                self.watched.insert(process);
                let instance = InstanceId::new(process.0).expect("a process key is an id");
                if self.exited_same_host.contains(&instance) {
                    // The pidfd of a peer that already exited is readable at once.
                    step.exits.push(instance);
                }
            }
            PeerAction::Unwatch { process } => {
                self.watched.remove(&process);
            }
            // Simulated connections carry no fds: how they are read is the same.
            PeerAction::ReadWithoutFds { .. } => {}
            // The simulated node has no deadline to authenticate (unbounded limits).
            PeerAction::Disconnect { .. } => {}
        }
    }

    pub(super) fn on_note(
        &mut self,
        now: Nanos,
        note: Note,
        call: &Call,
        checker: &mut Checker,
        step: &mut Step,
    ) {
        match note {
            Note::Stall { gap } => {
                self.stats.stalls += 1;
                checker.stall_reported(nanos_of(gap));
            }
            Note::ProcessExited { instance, held } => {
                // A process may hold instances besides the one it started as
                // (ids it claimed): any of them noted is the exit applied.
                step.exit_noted |= matches!(call, Call::Exit(_));
                checker.process_exited(now, instance, held);
            }
            Note::PoolAdopted(view) => {
                self.stats.adopted += view.adopted;
                self.stats.dropped_torn += view.dropped_torn;
                self.stats.dropped_taken += view.dropped_taken;
            }
            Note::EngineReleased {
                reservations_discarded,
                pins_released,
                ..
            } => {
                self.stats.reservations_discarded += reservations_discarded as u64 + pins_released;
            }
            Note::FreeHung {
                instance,
                module,
                watchdog,
            } => {
                self.stats.frees_hung += 1;
                let watchdog = nanos_of(watchdog);
                let longest = self
                    .free_runs
                    .values()
                    .filter(|(key, _, _)| *key == (instance, module))
                    .map(|&(_, start, paused)| {
                        (now - start).saturating_sub(self.paused_total - paused)
                    })
                    .max();
                if longest.is_none_or(|ran| ran < watchdog) {
                    checker.fail(
                        crate::violation::Class::Liveness,
                        "free_reported_hung_early",
                        format!(
                            "the node reported a free of instance {instance} ({}) hung \
                             after its watchdog of {:.3}s, but it has run {:.3}s: the \
                             server's own pause counted as the free's time",
                            module.label(),
                            crate::time::as_seconds(watchdog),
                            crate::time::as_seconds(longest.unwrap_or(0))
                        ),
                    );
                }
            }
            Note::L2StateChanged { .. } => self.stats.l2_state_changes += 1,
            _ => {}
        }
    }

    /// One node call (`None`: `handle_timeout`), its outputs carried out and reported
    /// to the checker.
    pub(super) fn call(
        &mut self,
        now: Nanos,
        input: Option<NodeInput>,
        call: Call,
        checker: &mut Checker,
        out: &mut ServerOut,
    ) {
        let at = self.core_now(now);
        let Some(node) = self.node.as_mut() else {
            return;
        };
        checker.handle_timeout(now);
        let reaped_before = node.liveness_status().reaped_total;
        match input {
            Some(input) => node.handle_input(at, input),
            None => node.handle_timeout(at),
        }
        let mut outputs = std::mem::take(&mut self.outputs);
        while let Some(output) = node.poll_output() {
            outputs.push(output);
        }
        self.before_outputs(now, &call, &outputs, checker);
        if self.spec.l2.enabled {
            self.l2_replies(&outputs, checker);
        }
        let mut step = Step::default();
        for output in outputs.drain(..) {
            self.carry_out(now, output, &call, checker, out, &mut step);
        }
        self.outputs = outputs;
        if let Call::Exit(instance) = call
            && !step.exit_noted
        {
            checker.fail(
                crate::violation::Class::Liveness,
                "exit_ignored",
                format!(
                    "the kernel proved that the process of instance {instance}, which the node \
                     watches, exited, and the node did not apply it"
                ),
            );
        }
        let reaped = self.reconcile(reaped_before, &step.freed, checker);
        out.reaped += reaped;
        let (l1_held, l1_explained) = match self.node.as_ref() {
            Some(node) if step.engine_freed => {
                let occupancy = node.l1_occupancy();
                (
                    occupancy.reserved + occupancy.pinned,
                    self.reserved_total + self.copies.len() + self.l2_holding + self.sealing,
                )
            }
            _ => (0, 0),
        };
        checker.end_step(&ShellView {
            blend: &self.blend,
            l1_held,
            l1_explained,
        });
        if self.bug == Some(InjectedBug::Panic) && reaped > 0 {
            panic!("injected bug: the simulated shell panics on its first reap");
        }
        for instance in step.exits {
            if self.watched.contains(&ProcessKey(instance.get())) {
                let input = NodeInput::ProcessExited {
                    process: ProcessKey(instance.get()),
                };
                self.call(now, Some(input), Call::Exit(instance), checker, out);
            }
        }
    }

    /// The node's answer, judged, then sent as the wire carries it (the shell encodes
    /// it).
    pub(super) fn answer(
        &mut self,
        conn: ConnId,
        request_id: u64,
        result: Result<Answer, ProtocolError>,
        checker: &mut Checker,
        out: &mut ServerOut,
    ) {
        if !self.tenant_reads.is_empty()
            && let Some((name, read)) = self.tenant_reads.remove(&(conn.0, request_id))
        {
            // Reads answered: never with a chunk another tenant stored (row 33).
            self.stats.foreign_misses += checker.read_answered(name, &read, &result);
        }
        let result = result.map(|answer| answer.to_value());
        self.reply(conn, request_id, result, out);
    }

    pub(super) fn reply(
        &mut self,
        conn: ConnId,
        request_id: u64,
        result: Result<Value, ProtocolError>,
        out: &mut ServerOut,
    ) {
        let Some(&(slot, incarnation, tcp)) = self.peers.get(&conn) else {
            return; // the connection is gone: nobody to answer
        };
        if let Err(error) = &result {
            match error.code {
                ErrorCode::BadArgs => self.stats.bad_args += 1,
                ErrorCode::Forbidden if tcp => self.stats.tcp_forbidden += 1,
                _ => {}
            }
        }
        if request_id >= HANDSHAKE_ID && result.is_ok() {
            return; // the client reads only a refusal of its connection's attach
        }
        out.replies.push(ReplyEnvelope {
            slot,
            incarnation,
            boot: self.boot,
            request_id,
            result,
        });
    }
}
