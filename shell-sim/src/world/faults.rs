//! Faults and operator actions, applied to the running world.

use super::World;
use crate::config::Action;
use crate::event::Event;
use crate::server::{ServerOut, ServerState};
use crate::time::Nanos;
use crate::worker::{Outbox, Process, Worker};

impl World {
    pub(super) fn apply(&mut self, action: Action) {
        let now = self.now;
        if self.verbose() {
            self.note(format!("fault: {action:?}"));
        }
        match action {
            Action::Crash(slots) => {
                for slot in slots {
                    self.crash(slot);
                }
            }
            Action::Restart(slots) => {
                for slot in slots {
                    self.crash(slot);
                    self.spawn(slot);
                }
            }
            Action::Freeze(slots) => {
                for slot in slots {
                    if let Some(worker) = self.workers[slot].as_mut() {
                        worker.freeze();
                    }
                    self.schedule_worker_wake(slot);
                }
            }
            Action::Thaw(slots) => {
                for slot in slots {
                    self.with_worker(slot, |worker, now, out| worker.thaw(now, out));
                }
            }
            Action::StarveHeartbeat(slots) => {
                for slot in slots {
                    if let Some(worker) = self.workers[slot].as_mut() {
                        worker.starve();
                    }
                }
            }
            Action::FeedHeartbeat(slots) => {
                for slot in slots {
                    self.with_worker(slot, |worker, now, out| worker.feed(now, out));
                }
            }
            Action::Stop(slots) => {
                for slot in slots {
                    self.with_worker(slot, |worker, now, out| worker.stop(now, out));
                }
            }
            Action::Unregister(slots) => {
                for slot in slots {
                    self.with_worker(slot, |worker, now, out| worker.unregister_all(now, out));
                }
            }
            Action::Register(slots) => {
                for slot in slots {
                    self.with_worker(slot, |worker, now, out| worker.register_again(now, out));
                }
            }
            Action::Transfer(slots) => {
                for slot in slots {
                    self.with_worker(slot, |worker, now, out| worker.transfer_once(now, out));
                }
            }
            Action::Partition(slots, direction) => {
                for slot in slots {
                    self.network.partition(slot, direction);
                }
            }
            Action::Heal(slots) => {
                for slot in slots {
                    self.network.heal(slot);
                }
            }
            Action::SetLink(slots, spec) => {
                for slot in slots {
                    self.network.set(slot, &spec);
                    self.max_link_delay = self.max_link_delay.max(self.network.max_delay(slot));
                }
            }
            Action::ServerPause => self.server.pause(now, &mut self.checker),
            Action::ServerResume => {
                let mut out = ServerOut::default();
                self.server.resume(now, &mut self.checker, &mut out);
                self.after_server(out);
            }
            Action::ServerRestart { down } => {
                if matches!(self.server.state, ServerState::Up | ServerState::Down) {
                    self.server.crash(now, &mut self.checker);
                    self.agenda.push(now + down, Event::ServerUp);
                }
            }
            Action::ServerStop => {
                let mut out = ServerOut::default();
                self.server.shut_down(now, &mut self.checker, &mut out);
                self.after_server(out);
            }
            Action::ClockStep(delta) => {
                self.server.wall_offset = self.server.wall_offset.saturating_add(delta);
                // The wall clock moved; the monotonic clock did not. A negative step is
                // also fed to the core once as a stale reading: state must not move back.
                if delta < 0 && self.server.is_turning() {
                    let stale = now.saturating_sub(delta.unsigned_abs());
                    let mut out = ServerOut::default();
                    self.server.wake(stale, &mut self.checker, &mut out);
                    self.after_server(out);
                }
            }
            Action::BuildFailureRate(rate) => self.build_failure_rate = rate,
            Action::HealAll => {
                self.build_failure_rate = 0.0;
                for slot in 0..self.workers.len() {
                    self.network.heal(slot);
                    self.with_worker(slot, |worker, now, out| {
                        worker.thaw(now, out);
                        worker.feed(now, out);
                    });
                }
                if self.server.paused {
                    let mut out = ServerOut::default();
                    self.server.resume(now, &mut self.checker, &mut out);
                    self.after_server(out);
                }
                if self.server.state == ServerState::Down {
                    self.start_server();
                }
            }
        }
    }

    pub(super) fn with_worker(
        &mut self,
        slot: usize,
        act: impl FnOnce(&mut Worker, Nanos, &mut Outbox),
    ) {
        let now = self.now;
        let Some(worker) = self.workers[slot].as_mut() else {
            return;
        };
        let healthy = worker.is_healthy();
        let mut out = Outbox::default();
        act(worker, now, &mut out);
        self.after_worker(slot, out, healthy);
    }

    pub(super) fn crash(&mut self, slot: usize) {
        let Some(worker) = self.workers[slot].as_mut() else {
            return;
        };
        if worker.process == Process::Dead {
            return;
        }
        worker.crash();
        self.exited(slot);
        self.schedule_worker_wake(slot);
    }
}
