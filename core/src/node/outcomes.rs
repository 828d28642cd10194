//! What comes back: builds, copies, blends and frees done, process exits; the
//! registry's effects; the free watchdog; the shutdown sequence.

use super::contexts::{CopyFor, CopyInFlight};
use super::shutdown::Step;
use crate::Effect;
use crate::node::{
    BlendChange, BlendId, Built, ConnId, ContextId, CopyId, FreeId, Job, Node, Note, Output,
    PeerAction, PendingBuild, PlantedBug, ProcessKey, SlotId, batches, blend, l2,
};
use crate::protocol::{Answer, ProtocolError};
use crate::protocol::{ErrorCode, Outcome};
use crate::time::Instant;
use crate::{BuildTicket, FreeCause, InstanceId, Module};
use std::time::Duration;

impl Node {
    pub(super) fn build_done(
        &mut self,
        now: Instant,
        context: ContextId,
        result: Result<Built, ProtocolError>,
    ) {
        let Some(PendingBuild {
            ticket,
            reply,
            waiters,
        }) = self.registry.builds.finish(context)
        else {
            return; // not a build of this node
        };
        self.conns.end_job(reply.conn, 1);
        let (instance, module) = (ticket.instance(), ticket.module());
        let answer = match result {
            Ok(built) => match self.adopt_built(now, ticket, context, built) {
                Some(answer) => answer,
                None => return, // planted: the built context is dropped unanswered
            },
            Err(error) => {
                self.doors.mapped.release(context);
                self.note(Note::BuildFailed {
                    instance,
                    error: error.clone(),
                });
                self.liveness.context_build_failed(now, ticket);
                self.drain_effects();
                Err(error)
            }
        };
        self.forget_if_gone(instance);
        for waiter in waiters {
            let answer = answer.as_ref().map_err(|error| {
                ProtocolError::new(
                    ErrorCode::NotRegistered,
                    format!(
                        "instance {instance} is not registered: the registration this one \
                         joined while it was being built failed ({}); register again",
                        error.message
                    ),
                )
            });
            match answer {
                Ok(()) => self.reply_registered(waiter, module, Outcome::Refreshed),
                Err(error) => self.reply(waiter, Err(error)),
            }
        }
        match answer {
            Ok(()) => self.reply_registered(reply, module, Outcome::Created),
            Err(error) => self.reply(reply, Err(error)),
        }
    }

    /// A context built: the node keeps it and hands it to the registry. A context whose
    /// entry went while it was built comes straight back (`Cancelled`) and the
    /// registration fails; any other outcome means it is the entry's now.
    fn adopt_built(
        &mut self,
        now: Instant,
        ticket: BuildTicket,
        context: ContextId,
        built: Built,
    ) -> Option<Result<(), ProtocolError>> {
        let (instance, module) = (ticket.instance(), ticket.module());
        self.counters.context_built();
        self.work.contexts.insert(context, built);
        if self.planted(PlantedBug::DropBuiltContext) {
            return None;
        }
        self.liveness.context_built(now, ticket, context);
        if self.drain_effects_seeing(context) {
            return Some(Err(ProtocolError::new(
                ErrorCode::NotRegistered,
                format!(
                    "instance {instance} was removed (unregistered, reaped or its process \
                     exited) while its context was being built; register again"
                ),
            )));
        }
        self.note(Note::ContextBuilt { instance, module });
        Some(Ok(()))
    }

    pub(super) fn copy_done(&mut self, copy: CopyId, result: Result<u64, ProtocolError>) {
        let Some((
            CopyInFlight {
                context,
                slot,
                purpose,
            },
            deferred,
        )) = self.work.contexts.end_copy(copy)
        else {
            return;
        };
        match purpose {
            CopyFor::Store(to) => {
                self.conns.end_job(to.conn, 1);
                let stored = self.stored(slot, result);
                self.reply(to, stored.map(|_| Answer::Flag(true)));
            }
            CopyFor::Retrieve(to) => {
                self.conns.end_job(to.conn, 1);
                self.l1.slots.unpin(slot);
                // A copy the shell did not start by its deadline: counted, as the node's.
                if result.is_err() {
                    self.past(to.deadline);
                }
                self.reply(to, result.map(|nbytes| Answer::Length(Some(nbytes))));
            }
            CopyFor::BatchStore { batch, item } => {
                let stored = self.stored(slot, result);
                self.item_done(batch, item, stored.map(Some));
            }
            CopyFor::BatchRetrieve { batch, item } => {
                self.l1.slots.unpin(slot);
                self.item_done(batch, item, result.map(Some));
            }
        }
        if let Some((instance, module, cause, label)) = deferred {
            self.start_free(context, instance, module, cause, label);
        }
    }

    /// A copy counted by [`Node::hold_copy`] that never ran (an L2 read that delivered
    /// nothing): its context is free of it, and a free that waited for it starts.
    pub(super) fn copy_dropped(&mut self, copy: CopyId) {
        if let Some((CopyInFlight { context, .. }, Some((instance, module, cause, label)))) =
            self.work.contexts.end_copy(copy)
        {
            self.start_free(context, instance, module, cause, label);
        }
    }

    /// Frees not yet finished: those started (a job in flight) and those deferred until
    /// their context's copies end. The one count `status` and shutdown's wait both read.
    pub(super) fn frees_unfinished(&self) -> usize {
        self.registry.frees.running() + self.work.contexts.deferred_frees()
    }

    /// A store's copy finished: publish the slot (its bytes), or give it back
    /// unpublished.
    fn stored(
        &mut self,
        slot: SlotId,
        result: Result<u64, ProtocolError>,
    ) -> Result<u64, ProtocolError> {
        match result {
            Ok(nbytes) => {
                self.l1.slots.commit(slot, nbytes);
                // Published (the copy completed): only now may it go to L2 (row 29).
                self.l2_write_behind(self.out.now, slot);
                Ok(nbytes)
            }
            Err(error) => {
                self.l1.slots.abort(slot);
                Err(error)
            }
        }
    }

    /// Item `item` of batch `id` ended: bytes moved, None for a miss, or the error
    /// that fails the whole batch. The last one answers it.
    pub(super) fn item_done(
        &mut self,
        id: u64,
        item: usize,
        result: Result<Option<u64>, ProtocolError>,
    ) {
        // Items naming the same key, waiting for this one's L2 read: served now, from
        // L1 when this one was (the read's hit is committed there), else a miss.
        let hit = matches!(result, Ok(Some(_)));
        for follower in self.work.batches.take_followers(id, item) {
            if let l2::ReadFor::BatchRetrieve {
                batch,
                item,
                instance,
                context,
                want,
            } = follower.waiter
            {
                self.resume_batch_item(batch, item, instance, context, want, &follower.key, hit);
            }
        }
        if let Some(answered) = self.work.batches.item_ended(id, item, result) {
            self.answer_batch(answered);
        }
    }

    /// A batch closed: its connection's items are free, and its reply goes out.
    pub(super) fn answer_batch(&mut self, answered: batches::Answered) {
        self.conns.end_job(answered.reply.conn, answered.items);
        self.reply(answered.reply, answered.result);
    }

    pub(super) fn blend_done(&mut self, id: BlendId, result: Result<(), String>) {
        let Some((to, instance)) = self.blend.reported(id) else {
            return;
        };
        self.conns.end_job(to.conn, 1);
        let answer = match result {
            Err(message) => {
                self.blend.abandon(id, instance);
                Err(ProtocolError::new(
                    ErrorCode::Unavailable,
                    format!("`register_blend`: {message}"),
                ))
            }
            Ok(()) => match self.blend.finish(id, instance) {
                blend::Finished::Installed => {
                    self.out.queue.push_back(Output::Blend(BlendChange::Keep {
                        blend: id,
                        instance,
                    }));
                    let bytes = self.blend.bytes_of(instance);
                    self.note(Note::BlendHeld { instance, bytes });
                    Ok(Answer::Flag(true))
                }
                blend::Finished::Superseded => {
                    self.out
                        .queue
                        .push_back(Output::Blend(BlendChange::Discard { blend: id }));
                    Ok(Answer::Flag(true))
                }
                blend::Finished::Freed => {
                    self.out
                        .queue
                        .push_back(Output::Blend(BlendChange::Discard { blend: id }));
                    Err(ProtocolError::new(
                        ErrorCode::NotRegistered,
                        format!(
                            "`register_blend`: instance {instance} was freed (unregistered, \
                             reaped or its process exited) while its rope tables were \
                             computed; register again"
                        ),
                    ))
                }
            },
        };
        self.reply(to, answer);
    }

    pub(super) fn free_done(&mut self, now: Instant, free: FreeId) {
        if let Some(late) = self.registry.frees.done(free, now) {
            self.note(late);
        }
    }

    pub(super) fn process_exited(&mut self, now: Instant, process: ProcessKey) {
        let instances = self.registry.watches.exited(process);
        self.out
            .queue
            .push_back(Output::Peer(PeerAction::Unwatch { process }));
        for instance in instances {
            if self.planted(PlantedBug::IgnoreProcessExit) {
                continue;
            }
            let held = self.liveness.process_exited(now, instance);
            self.note(Note::ProcessExited { instance, held });
            self.drain_effects();
        }
    }

    /// Watches the process of `conn`'s peer for `instance`: the newest registrant's
    /// process is the instance's proof of exit.
    pub(super) fn watch(&mut self, conn: ConnId, instance: InstanceId) {
        let Some((process, notice)) = self.conns.get(&conn).and_then(|c| c.process) else {
            return;
        };
        let change = self.registry.watches.watch(instance, process, notice);
        if let Some(process) = change.stop {
            self.out
                .queue
                .push_back(Output::Peer(PeerAction::Unwatch { process }));
        }
        if change.start {
            self.out
                .queue
                .push_back(Output::Peer(PeerAction::Watch { process, conn }));
        }
    }

    fn unwatch(&mut self, instance: InstanceId) {
        if let Some(process) = self.registry.watches.unwatch(instance) {
            self.out
                .queue
                .push_back(Output::Peer(PeerAction::Unwatch { process }));
        }
    }

    /// Drops what the node keeps of an instance's entries that the registry no longer
    /// holds; an instance holding nothing is no longer watched.
    pub(super) fn forget_if_gone(&mut self, instance: InstanceId) {
        let mut any = false;
        for module in Module::ALL {
            if self.liveness.entry(instance, module).is_none() {
                self.registry.records.remove(&(instance, module));
            } else {
                any = true;
            }
        }
        if !any {
            self.unwatch(instance);
            self.doors.trust.release(instance);
        }
    }

    /// Carries out every effect the registry queued.
    pub(super) fn drain_effects(&mut self) {
        self.drain_effects_seeing(ContextId(0));
    }

    /// Carries out every effect; true when `context` came back among them.
    fn drain_effects_seeing(&mut self, watched: ContextId) -> bool {
        let mut seen = false;
        while let Some(effect) = self.liveness.poll_effect() {
            match effect {
                Effect::FreeContext {
                    instance,
                    module,
                    context,
                    cause,
                } => {
                    seen |= context == watched;
                    self.free(instance, module, context, cause);
                }
                Effect::DropBlendState { instance } => {
                    if self.planted(PlantedBug::KeepBlendState) {
                        continue;
                    }
                    if let Some(bytes) = self.blend.drop_instance(instance) {
                        self.out
                            .queue
                            .push_back(Output::Blend(BlendChange::Drop { instance }));
                        self.note(Note::BlendDropped { instance, bytes });
                    }
                    self.forget_if_gone(instance);
                }
                Effect::StallDetected { gap } => {
                    self.credit_stall(gap);
                    self.note(Note::Stall { gap });
                }
            }
        }
        seen
    }

    /// The server itself did not run for `gap` (SIGSTOP, a VM pause: every thread
    /// stopped): neither did its frees nor the work a shutdown waits for, so their
    /// timers do not count it, as the registry does not count it as silence. Without
    /// this a free running when the server was paused for longer than the watchdog is
    /// reported hung on resume (found by the simulator: a free across a server pause).
    fn credit_stall(&mut self, gap: Duration) {
        let now = self.out.now;
        self.registry.frees.credit_stall(now, gap);
        self.shutdown.credit_stall(now, gap);
    }

    /// The registry handed a context back: release what it holds in L1 now, then free
    /// it once no copy uses it.
    fn free(&mut self, instance: InstanceId, module: Module, context: ContextId, cause: FreeCause) {
        let label = if self.shutdown.begun() && cause == FreeCause::Unregistered {
            "shutdown"
        } else {
            cause.label()
        };
        self.forget_if_gone(instance);
        if let Some(mut strategy) = self.work.contexts.take_strategy(context) {
            if self.planted(PlantedBug::KeepReservations) {
                std::mem::forget(strategy);
            } else {
                let released = strategy.release(&mut self.l1.slots);
                if released.reservations_discarded > 0 || released.pins_released > 0 {
                    self.note(Note::EngineReleased {
                        instance,
                        label,
                        reservations_discarded: released.reservations_discarded,
                        pins_released: released.pins_released,
                    });
                }
            }
        }
        let free = (instance, module, cause, label);
        if self.planted(PlantedBug::FreeDuringCopy) {
            self.start_free(context, instance, module, cause, label);
        } else if let Err((instance, module, cause, label)) =
            self.work.contexts.defer_free(context, free)
        {
            self.start_free(context, instance, module, cause, label);
        }
    }

    fn start_free(
        &mut self,
        context: ContextId,
        instance: InstanceId,
        module: Module,
        cause: FreeCause,
        label: &'static str,
    ) {
        self.work.contexts.remove(context);
        self.doors.mapped.release(context);
        self.registry.frees.count(label);
        self.shutdown.count_free();
        if self.planted(PlantedBug::LeakOnFree) {
            return;
        }
        // Planted bug `DoubleFree` sends the same free twice, under two ids.
        let sends = if self.planted(PlantedBug::DoubleFree) {
            2
        } else {
            1
        };
        for _ in 0..sends {
            let free = FreeId(self.out.next_id());
            self.registry
                .frees
                .started(free, instance, module, self.out.now);
            self.out.queue.push_back(Output::Job(Job::Free {
                free,
                context,
                instance,
                module,
                cause,
                label,
            }));
        }
    }

    pub(super) fn check_free_watchdog(&mut self, now: Instant) {
        for hung in self
            .registry
            .frees
            .newly_hung(now, self.config.free_watchdog)
        {
            self.note(hung);
        }
    }

    /// Advances a shutdown ([`shutdown`]): the node tells it whether the work in flight
    /// has drained and how many frees are unfinished, and carries out its steps.
    pub(super) fn step_shutdown(&mut self, now: Instant) {
        // Every node call steps it: with no shutdown under way, count nothing (the
        // unfinished frees are a scan of the contexts).
        while self.shutdown.under_way() {
            // Seals count as work in flight: an upgrade's restart adopts what was sealed
            // (row 71).
            let drained = self.conns.jobs_in_flight() == 0 && self.l1.slots.sealing() == 0;
            match self.shutdown.step(now, drained, self.frees_unfinished()) {
                Step::Wait => return,
                Step::FreeEverything => {
                    // Copies still waiting for the pool never run: answered, and their
                    // contexts' frees no longer wait for them.
                    for copy in self.work.jobs.take_waiting_copies() {
                        self.cancel_copy(copy);
                    }
                    if self.planted(PlantedBug::ShutdownLeaks) {
                        continue;
                    }
                    let keys: Vec<(InstanceId, Module)> =
                        self.registry.records.keys().copied().collect();
                    for (instance, module) in keys {
                        self.liveness.unregister(now, instance, module);
                    }
                    self.drain_effects();
                }
                Step::Stop {
                    contexts_freed,
                    frees_unfinished,
                } => {
                    self.out.queue.push_back(Output::Stopped {
                        contexts_freed,
                        frees_unfinished,
                    });
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;
    use crate::node::DeathNotice;
    use crate::node::Input;
    use crate::node::NodeConfig;
    use crate::node::SHUTDOWN_DRAIN;
    use crate::node::Transport;
    use crate::node::TrustConfig;
    use crate::protocol::Op;

    const SECOND: u64 = 1_000_000_000;

    fn at(seconds: f64) -> Instant {
        Instant::from_nanos((seconds * SECOND as f64) as u64)
    }

    fn node() -> Node {
        let config = NodeConfig {
            liveness: Config {
                reap_timeout: Duration::from_secs(120),
                registration_grace: Duration::from_secs(3600),
                resolution: Duration::from_secs(1),
                stall_threshold: Duration::from_secs(5),
            },
            reap_timeout_floor: Duration::ZERO,
            num_slots: 4,
            slot_bytes: 4096,
            server_uid: 1000,
            trust: TrustConfig::default(),
            boot_id: 1,
            server_name: "test".into(),
            free_watchdog: Duration::from_secs(10),
            shutdown_drain: SHUTDOWN_DRAIN,
            cuda_devices: Err("none".into()),
            l2: None,
            connections: crate::node::admission::ConnectionLimits::unbounded(),
            mapped: crate::node::mapped::MappedLimits::unbounded(),
            pool_window: crate::node::jobs::UNBOUNDED,
            kv_publish: Vec::new(),
        };
        Node::new(config, at(0.0)).unwrap()
    }

    fn drain(node: &mut Node) -> Vec<Output> {
        std::iter::from_fn(|| node.poll_output()).collect()
    }

    /// A free running when the server is paused (SIGSTOP stops its threads too) for
    /// longer than the watchdog is not reported hung on resume; one that then really
    /// runs past the watchdog still is.
    #[test]
    fn a_server_pause_is_not_time_a_free_ran() {
        let mut node = node();
        let instance = InstanceId::new(7).unwrap();
        let conn = ConnId(1);
        node.handle_input(
            at(0.0),
            Input::Connected {
                conn,
                uid: Some(1000),
                transport: Transport::Unix,
                process: Some((ProcessKey(7), DeathNotice::PidfdByPid)),
            },
        );
        node.handle_input(
            at(0.0),
            Input::Request {
                conn,
                request_id: 0,
                op: Op::Attach {
                    instance,
                    secret: vec![1; 32],
                },
                fds: 0,
            },
        );
        node.handle_input(
            at(0.0),
            Input::Request {
                conn,
                request_id: 1,
                op: Op::RegisterEngineDriven {
                    instance,
                    model_name: "m".into(),
                    world_size: 1,
                },
                fds: 0,
            },
        );
        let context = drain(&mut node)
            .into_iter()
            .find_map(|output| match output {
                Output::Job(Job::Build { context, .. }) => Some(context),
                _ => None,
            })
            .expect("a build");
        node.handle_input(
            at(0.1),
            Input::BuildDone {
                context,
                result: Ok(Built::EngineDriven),
            },
        );
        node.handle_input(
            at(1.0),
            Input::ProcessExited {
                process: ProcessKey(7),
            },
        );
        let outputs = drain(&mut node);
        assert!(
            outputs
                .iter()
                .any(|output| matches!(output, Output::Job(Job::Free { .. }))),
            "{outputs:?}"
        );
        // Paused from 1.2 s to 31.2 s: the first turn after it credits the stall.
        node.handle_timeout(at(31.2));
        let hung = |outputs: &[Output]| {
            outputs
                .iter()
                .any(|output| matches!(output, Output::Note(Note::FreeHung { .. })))
        };
        let outputs = drain(&mut node);
        assert!(
            outputs
                .iter()
                .any(|output| matches!(output, Output::Note(Note::Stall { .. }))),
            "{outputs:?}"
        );
        assert!(!hung(&outputs), "{outputs:?}");
        // The whole gap since the last input is credited, as the registry credits it:
        // the watchdog counts from 31.2 s.
        for tenth in 1..=98 {
            node.handle_timeout(at(31.2 + f64::from(tenth) / 10.0));
            assert!(!hung(&drain(&mut node)));
        }
        node.handle_timeout(at(41.3));
        assert!(hung(&drain(&mut node)));
    }
}
