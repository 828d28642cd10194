//! The server's side of the world: envelopes into the simulated server over their
//! connections, its outputs out (replies, frees, reaps), and its (re)start.

use super::World;
use crate::event::Event;
use crate::message::{Envelope, Payload, ReplyEnvelope};
use crate::network::Way;
use crate::server::{Input, ServerOut, ServerState};
use crate::time::MILLISECOND;
use crate::violation::Class;
use crate::worker::Outbox;
use kvwarden_core::{FreeCause, InstanceId, Module};

impl World {
    pub(super) fn deliver_to_server(&mut self, mut envelope: Envelope) {
        if !matches!(self.server.state, ServerState::Up | ServerState::Draining)
            || envelope.boot != self.server.boot
        {
            return; // the connection it travelled on is gone
        }
        // A connection the process replaced (it reconnected, or drew a fresh id) is
        // closed: what still travelled on it is lost.
        let line = (
            envelope.boot,
            envelope.slot,
            envelope.incarnation,
            envelope.channel,
        );
        // Only processes that moved past their first connection are recorded.
        if envelope.epoch > 0 || !self.socket_epochs.is_empty() {
            let newest = self.socket_epochs.entry(line).or_insert(envelope.epoch);
            if envelope.epoch < *newest {
                return;
            }
            *newest = envelope.epoch;
        }
        if let Payload::Bytes(bytes) = &envelope.payload {
            let decoded = kvwarden_core::protocol::decode_request(bytes);
            envelope.payload = Payload::Decoded(decoded);
        }
        // Evidence of life: a request of the process naming its own instance reached
        // the socket, whether or not the server has read it yet (unless the id is
        // bound to another secret: the process's requests naming it are refused).
        let own = !envelope.tcp
            && envelope.secret.is_some_and(|secret| {
                self.checker
                    .would_attach(envelope.instance, &secret, envelope.uid)
            });
        match envelope.op() {
            _ if !own => {}
            Some(kvwarden_core::protocol::Op::Ping {
                instance: Some(named),
            }) if *named == envelope.instance => {
                self.checker.arrived(self.now, envelope.instance, None);
            }
            Some(kvwarden_core::protocol::Op::Ping { .. }) | None => {}
            Some(op) if op.instance() == Some(envelope.instance) => {
                for module in Module::ALL {
                    self.checker
                        .arrived(self.now, envelope.instance, Some(module));
                }
            }
            Some(_) => {}
        }
        if self.trace_requests {
            let line = format!("server reads w{} {:?}", envelope.slot, envelope.payload);
            self.note(line);
        }
        self.server_input(Input::Request(envelope));
    }

    /// SIGSTOP of the server process.
    pub(super) fn pause_server(&mut self) {
        if !self.server.paused {
            self.paused_at = self.now;
        }
        self.server.pause(self.now, &mut self.checker);
    }

    /// SIGCONT: the queued input first, then the jobs of its threads go on.
    pub(super) fn resume_server(&mut self) {
        if !self.server.paused {
            return;
        }
        let mut out = ServerOut::default();
        self.server.resume(self.now, &mut self.checker, &mut out);
        self.after_server(out);
        for (remaining, event) in std::mem::take(&mut self.frozen_jobs) {
            self.agenda.push(self.now + remaining, event);
        }
    }

    pub(super) fn server_input(&mut self, input: Input) {
        let mut out = ServerOut::default();
        self.server
            .input(self.now, input, &mut self.checker, &mut out);
        self.after_server(out);
    }

    pub(super) fn after_server(&mut self, out: ServerOut) {
        let now = self.now;
        for reply in out.replies {
            self.send_reply(reply);
        }
        for build in out.builds {
            let (low, high) = self.cfg.server.build_delay;
            let delay = self.rng.between(low, high);
            let failed = self.rng.chance(self.build_failure_rate);
            let boot = self.server.boot;
            self.agenda.push(
                now + delay,
                Event::BuildDone {
                    boot,
                    build,
                    failed,
                },
            );
        }
        let boot = self.server.boot;
        for copy in out.copies {
            self.agenda.push(
                now + self.cfg.server.copy_duration,
                Event::CopyDone { boot, copy },
            );
        }
        for job in out.pool_jobs {
            let delay = match job {
                crate::pool::PoolJob::Seal { .. } => self.cfg.server.copy_duration,
                crate::pool::PoolJob::Scan { .. } => self.cfg.server.scan_duration,
            };
            self.agenda.push(now + delay, Event::PoolDone { boot, job });
        }
        for blend in out.blends {
            self.agenda
                .push(now + MILLISECOND, Event::BlendDone { boot, blend });
        }
        for free in out.free_jobs {
            if self.free_hang_rate > 0.0 && self.rng.chance(self.free_hang_rate) {
                self.note(format!("free {free} hangs (it never returns)"));
                continue;
            }
            self.agenda.push(
                now + self.cfg.server.free_delay,
                Event::FreeDone { boot, free },
            );
        }
        self.issue_l2(boot, out.l2_jobs);
        self.record_frees(out.frees);
        if out.reaped > 0 {
            self.mix(12 ^ out.reaped << 8);
        }
        self.schedule_server_wake();
    }

    /// Each L2 job's answer, due after its simulated delay (a given-up read at once).
    fn issue_l2(&mut self, boot: u64, jobs: Vec<crate::l2::L2Job>) {
        let now = self.now;
        for job in jobs {
            if let crate::l2::L2Job::Cancelled { .. } = job {
                let fate = crate::l2::L2Fate::TimedOut;
                self.agenda.push(now, Event::L2Done { boot, job, fate });
                continue;
            }
            let roll = match job {
                crate::l2::L2Job::Get { .. } if self.server.l2.corrupt_rate > 0.0 => {
                    self.rng.unit()
                }
                _ => 1.0,
            };
            let flaky = if self.server.l2.flaky_rate > 0.0 {
                self.rng.unit()
            } else {
                1.0
            };
            let (delay, fate) = self.server.l2.issue(roll, flaky);
            self.agenda
                .push(now + delay, Event::L2Done { boot, job, fate });
        }
    }

    /// The frees the node decided: mixed into the trace, reaps noted.
    fn record_frees(&mut self, frees: Vec<crate::server::FreeRecord>) {
        let now = self.now;
        for record in frees {
            self.mix(11 ^ record.context << 8 ^ cause_code(record.cause) << 56);
            if let FreeCause::Reaped { .. } = record.cause {
                self.reaps.push((record.instance, now));
            }
            if self.verbose() {
                let name = self.name_of(record.instance);
                let detail = match record.cause {
                    FreeCause::Reaped { silence, proven } => format!(
                        " after {:.3}s of silence (proven: {proven})",
                        silence.as_secs_f64()
                    ),
                    _ => String::new(),
                };
                self.note(format!(
                    "context {} of {name} ({}) freed: {}{detail}",
                    record.context,
                    record.module.label(),
                    record.cause.label()
                ));
            }
            self.frees.push((now, record));
        }
    }

    pub(super) fn send_reply(&mut self, reply: ReplyEnvelope) {
        if reply.slot >= self.workers.len() {
            return; // a TCP probe's: the checker read it at the server
        }
        let arrivals = self
            .network
            .send(&mut self.rng, self.now, reply.slot, Way::ToWorker);
        match arrivals {
            [Some(first), Some(second)] => {
                self.agenda
                    .push(first, Event::ToWorker(Box::new(reply.clone())));
                self.agenda.push(second, Event::ToWorker(Box::new(reply)));
            }
            [Some(first), None] => self.agenda.push(first, Event::ToWorker(Box::new(reply))),
            _ => {}
        }
    }

    pub(super) fn deliver_to_worker(&mut self, envelope: ReplyEnvelope) {
        if envelope.boot != self.server.boot
            || !matches!(self.server.state, ServerState::Up | ServerState::Draining)
        {
            return; // the connection broke with the server
        }
        let slot = envelope.slot;
        let Some(worker) = self.workers[slot].as_mut() else {
            return;
        };
        if worker.incarnation != envelope.incarnation {
            return; // addressed to a process that is gone
        }
        let healthy = worker.is_healthy();
        let mut out = Outbox::default();
        worker.on_reply(self.now, envelope.request_id, envelope.result, &mut out);
        self.after_worker(slot, out, healthy);
    }

    pub(super) fn name_of(&self, instance: InstanceId) -> String {
        for (slot, incarnations) in self.instances.iter().enumerate() {
            if let Some(incarnation) = incarnations.iter().position(|ids| ids.contains(&instance)) {
                return format!("{}#{incarnation}", self.cfg.workers[slot].name);
            }
        }
        format!("instance {instance}")
    }

    pub(super) fn start_server(&mut self) {
        if let Err(error) = self.server.start(self.now) {
            self.checker.fail(Class::Internal, "server_start", error);
            return;
        }
        self.checker.server_restarted(self.now);
        self.note("server up (empty registry)".to_string());
        if self.cfg.server.pool_file {
            // Its first turn hands out the scan of the pool file it adopts.
            let mut out = ServerOut::default();
            self.server.wake(self.now, &mut self.checker, &mut out);
            self.after_server(out);
        }
        self.schedule_server_wake();
    }
}

fn cause_code(cause: FreeCause) -> u64 {
    match cause {
        FreeCause::Unregistered => 1,
        FreeCause::Reaped { proven, .. } => 2 + u64::from(proven),
        FreeCause::ProcessExited => 4,
        FreeCause::Cancelled => 5,
    }
}
