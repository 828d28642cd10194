//! Faults and operator actions, applied to the running world.

use super::World;
use crate::config::Action;
use crate::event::Event;
use crate::message::{Channel, Envelope, Payload};
use crate::server::{ServerOut, ServerState};
use crate::time::Nanos;
use crate::worker::{Outbox, Process, Worker};
use kvwarden_core::protocol::{BufferSpec, Op};

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
            Action::ServerPause => self.pause_server(),
            Action::ServerResume => self.resume_server(),
            Action::ServerRestart { down } => {
                if matches!(self.server.state, ServerState::Up | ServerState::Down) {
                    self.frozen_jobs.clear();
                    self.server.crash(now, &mut self.checker);
                    self.agenda.push(now + down, Event::ServerUp);
                }
            }
            Action::ServerStop => {
                for (remaining, event) in std::mem::take(&mut self.frozen_jobs) {
                    self.agenda.push(now + remaining, event);
                }
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
            Action::FreeHangRate(rate) => self.free_hang_rate = rate,
            Action::Intrude(from, target) => self.intrude(from, target),
            Action::L2Down => self.server.l2.down = true,
            Action::L2Partition => self.server.l2.partitioned = true,
            Action::L2Up => {
                self.server.l2.down = false;
                self.server.l2.partitioned = false;
                self.server.l2.slow = None;
            }
            Action::L2Slow(delay) => self.server.l2.slow = Some(delay),
            Action::L2Corrupt(rate) => self.server.l2.corrupt_rate = rate,
            Action::L2Flaky(rate) => self.server.l2.flaky_rate = rate,
            Action::L2Garble(slots) => {
                for slot in slots {
                    if let Some(worker) = self.workers[slot].as_ref() {
                        // The workers' keys begin with their instance id.
                        let prefix = worker.instance.get().to_le_bytes();
                        self.server.l2.garble(&prefix);
                    }
                }
            }
            Action::HealAll => {
                self.build_failure_rate = 0.0;
                self.free_hang_rate = 0.0;
                self.server.l2.heal();
                for slot in 0..self.workers.len() {
                    self.network.heal(slot);
                    self.with_worker(slot, |worker, now, out| {
                        worker.thaw(now, out);
                        worker.feed(now, out);
                    });
                }
                self.resume_server();
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

    /// Row 23: the process in slot `from` names the instance of the process in slot
    /// `target` in a ping, a REGISTER, a transfer and an UNREGISTER of every module.
    fn intrude(&mut self, from: usize, target: usize) {
        let Some(victim) = self.workers[target].as_ref().map(|w| w.instance) else {
            return;
        };
        let Some(worker) = self.workers[from].as_ref() else {
            return;
        };
        if worker.process != Process::Running {
            return;
        }
        let ops = [
            Op::Ping {
                instance: Some(victim),
            },
            Op::RegisterKvCache {
                instance: victim,
                buffers: vec![BufferSpec::Memfd {
                    fd_index: 0,
                    nbytes: crate::worker::BUFFER_BYTES,
                }],
                model_name: "intruder".to_string(),
                world_size: 1,
            },
            Op::Store {
                instance: victim,
                key: b"intruder".to_vec(),
                buffer: 0,
                offset: 0,
                nbytes: 16,
            },
            Op::PrepareStore {
                instance: victim,
                key: b"intruder".to_vec(),
            },
            Op::UnregisterKvCache { instance: victim },
            Op::UnregisterEngineDriven { instance: victim },
        ];
        let base = Envelope {
            slot: from,
            incarnation: worker.incarnation,
            instance: worker.instance,
            boot: self.server.boot,
            sent_at: self.now,
            exiting: false,
            channel: Channel::Main,
            uid: worker.spec().uid,
            same_host: worker.spec().same_host,
            payload: Payload::Bytes(Vec::new()),
        };
        if !matches!(self.server.state, ServerState::Up | ServerState::Draining) {
            return;
        }
        for (index, op) in ops.into_iter().enumerate() {
            let fds = usize::from(matches!(op, Op::RegisterKvCache { .. }));
            let mut envelope = base.clone();
            envelope.payload = Payload::Op {
                id: (1 << 62) + index as u64,
                op,
                fds,
            };
            self.send_request(envelope);
        }
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
