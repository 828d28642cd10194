//! Faults and operator actions, applied to the running world.

use super::World;
use crate::config::{Action, MAX_IMPERSONATED, TokenChoice};
use crate::event::Event;
use crate::message::{Channel, Envelope, Payload};
use crate::server::{ServerOut, ServerState};
use crate::time::{MILLISECOND, Nanos};
use crate::worker::{Outbox, ProcessState, STORE_BYTES, Worker};
use kvwarden_core::InstanceId;
use kvwarden_core::protocol::{BufferSpec, Op, RetrieveItem, RopeSpec};

impl World {
    pub(super) fn apply(&mut self, action: Action) {
        if self.verbose() {
            self.note(format!("fault: {action:?}"));
        }
        match action {
            action @ (Action::Crash(_)
            | Action::Restart(_)
            | Action::Freeze(_)
            | Action::Thaw(_)
            | Action::StarveHeartbeat(_)
            | Action::FeedHeartbeat(_)
            | Action::Stop(_)
            | Action::Unregister(_)
            | Action::Register(_)
            | Action::Transfer(_)
            | Action::Partition(..)
            | Action::Heal(_)
            | Action::SetLink(..)) => self.worker_fault(action),
            action @ (Action::L2Down
            | Action::L2Partition
            | Action::L2Up
            | Action::L2Slow(_)
            | Action::L2Corrupt(_)
            | Action::L2Flaky(_)
            | Action::L2Garble(_)) => self.l2_fault(action),
            Action::Intrude(from, target) => {
                if let Some(victim) = self.workers[target].as_ref().map(|w| w.instance) {
                    self.intrude(from, &[victim]);
                }
            }
            Action::Impersonate(from) => self.impersonate(from),
            Action::Poach(from) => self.poach(from),
            Action::TcpProbe(token) => self.tcp_probe(token),
            action => self.server_fault(action),
        }
    }

    /// A fault of workers' processes, heartbeats and links.
    fn worker_fault(&mut self, action: Action) {
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
            _ => {}
        }
    }

    /// A fault of the server, its clock or its jobs, or the end of every fault.
    fn server_fault(&mut self, action: Action) {
        let now = self.now;
        match action {
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
            _ => {}
        }
    }

    /// A fault of L2.
    fn l2_fault(&mut self, action: Action) {
        match action {
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
                        // The node keys a chunk with its tenant's prefix, then the
                        // worker's key, which begins with its instance id.
                        let mut prefix = crate::invariants::prefix_of(
                            &crate::invariants::uid_tenant(worker.spec().uid),
                        );
                        prefix.extend_from_slice(&worker.instance.get().to_le_bytes());
                        self.server.l2.garble(&prefix);
                    }
                }
            }
            _ => {}
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

    /// A request id for an adversary's request: above any client's own, never reused.
    fn adversary_id(&mut self) -> u64 {
        self.adversary_serial += 1;
        (1 << 62) + self.adversary_serial
    }

    /// Sends `ops` as the process in slot `from`, on its own (attached) connection.
    fn send_as(&mut self, from: usize, ops: Vec<Op>) {
        if !matches!(self.server.state, ServerState::Up | ServerState::Draining) {
            return;
        }
        let running = self.workers[from]
            .as_ref()
            .is_some_and(|w| w.process == ProcessState::Running && !w.is_shutting_down());
        if !running {
            return;
        }
        for op in ops {
            let fds = usize::from(matches!(op, Op::RegisterKvCache { .. }));
            let id = self.adversary_id();
            let payload = Payload::Op { id, op, fds };
            if let Some(envelope) = self.envelope_of(from, Channel::Main, payload) {
                self.send_request(envelope);
            }
        }
    }

    /// A secret nobody drew with the instance (the impostor's guess).
    fn wrong_secret(&mut self) -> Vec<u8> {
        let mut secret = vec![0u8; 32];
        for chunk in secret.chunks_mut(8) {
            chunk.copy_from_slice(&self.rng.next_u64().to_le_bytes());
        }
        secret
    }

    /// Everything an impostor tries with another's instance id `victim`: a ping, a
    /// REGISTER, a store from and a retrieve into the victim's buffers, a prepare,
    /// `register_blend`, both UNREGISTERs, and an `attach` with a wrong secret.
    fn intrusion(&mut self, victim: InstanceId) -> Vec<Op> {
        vec![
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
            Op::Retrieve {
                instance: victim,
                key: b"intruder".to_vec(),
                buffer: 0,
                offset: 0,
                nbytes: STORE_BYTES,
            },
            Op::PrepareStore {
                instance: victim,
                key: b"intruder".to_vec(),
            },
            Op::RegisterBlend {
                instance: victim,
                rope: RopeSpec {
                    rotary_dim: 64,
                    max_positions: 1024,
                    base: 10_000.0,
                },
            },
            Op::UnregisterKvCache { instance: victim },
            Op::UnregisterEngineDriven { instance: victim },
            Op::Attach {
                instance: victim,
                secret: self.wrong_secret(),
            },
        ]
    }

    /// Rows 23, 30, 31: the process in slot `from` names each of `victims` in
    /// everything of [`World::intrusion`], on its own connection, which attached only
    /// its own instance (and whatever its wrong-secret attaches claimed).
    fn intrude(&mut self, from: usize, victims: &[InstanceId]) {
        let mut ops = Vec::new();
        for &victim in victims {
            ops.extend(self.intrusion(victim));
        }
        self.send_as(from, ops);
    }

    /// Rows 30–31: an impostor reads every instance id from the node's status (and
    /// keeps those it read before a server restart) and intrudes on at most
    /// [`MAX_IMPERSONATED`] of them, its own excepted.
    fn impersonate(&mut self, from: usize) {
        self.read_status();
        let Some(own) = self.workers[from].as_ref().map(|w| w.instance) else {
            return;
        };
        let mut known: Vec<InstanceId> = self
            .seen_ids
            .iter()
            .copied()
            .filter(|&id| id != own)
            .collect();
        while known.len() > MAX_IMPERSONATED {
            let drop = self.rng.between(0, known.len() as u64 - 1) as usize;
            known.remove(drop);
        }
        if self.verbose() {
            let name = self.cfg.workers[from].name.clone();
            self.note(format!("{name} impersonates instances {known:?}"));
        }
        self.intrude(from, &known);
    }

    /// What an impostor learns from the node's status page: every instance id.
    pub(super) fn read_status(&mut self) {
        if let Some(node) = self.server.node() {
            self.seen_ids
                .extend(node.status().instances.iter().map(|view| view.instance));
        }
    }

    /// Row 33 (and 35): the process in slot `from` stores, retrieves and looks up the
    /// keys of every worker of another tenant (what they stored last, what they store
    /// next: a chunk's key is a function of its content) with its own instance, and
    /// tries to register engine-driven.
    fn poach(&mut self, from: usize) {
        let Some(poacher) = self.workers[from].as_ref() else {
            return;
        };
        let (own, uid) = (poacher.instance, poacher.spec().uid);
        let mut ops = Vec::new();
        for slot in 0..self.workers.len() {
            let Some(victim) = self.workers[slot].as_ref() else {
                continue;
            };
            if slot == from || victim.spec().uid == uid || victim.process == ProcessState::Dead {
                continue;
            }
            let keys = victim.recent_keys();
            // Pre-store ("poison") some of the keys it stores next.
            for key in keys.iter().skip(1).take(4) {
                if self.rng.chance(0.5) {
                    ops.push(Op::Store {
                        instance: own,
                        key: key.clone(),
                        buffer: 0,
                        offset: 0,
                        nbytes: STORE_BYTES,
                    });
                }
            }
            // Read what it stored (and what it is about to store).
            let first = keys[0].clone();
            ops.push(Op::Retrieve {
                instance: own,
                key: first.clone(),
                buffer: 0,
                offset: 0,
                nbytes: STORE_BYTES,
            });
            let items = keys
                .iter()
                .take(3)
                .enumerate()
                .map(|(index, key)| RetrieveItem {
                    key: key.clone(),
                    buffer: 0,
                    offset: index as u64 * STORE_BYTES,
                    nbytes: STORE_BYTES,
                })
                .collect();
            ops.push(Op::RetrieveBatch {
                instance: own,
                items,
            });
            ops.push(Op::Lookup {
                keys: keys.iter().take(3).cloned().collect(),
            });
        }
        if self.rng.chance(0.25) {
            // Row 35: an untrusted tenant may not map the whole pool.
            ops.push(Op::RegisterEngineDriven {
                instance: own,
                model_name: "poacher".to_string(),
                world_size: 1,
            });
        }
        self.send_as(from, ops);
    }

    /// Row 32: a TCP peer connects, says `hello` with `token`, then names every known
    /// instance (ping, attach with a wrong secret, a REGISTER, a store, a retrieve, an
    /// UNREGISTER), looks keys up and asks for the status; its connection closes 1 ms
    /// later.
    fn tcp_probe(&mut self, token: TokenChoice) {
        if !matches!(self.server.state, ServerState::Up | ServerState::Draining) {
            return;
        }
        self.read_status();
        let token = match token {
            TokenChoice::Missing => None,
            TokenChoice::Wrong => Some(self.wrong_secret()),
            TokenChoice::Right => self.cfg.server.tcp_token.clone(),
        };
        let slot = self.workers.len();
        self.tcp_probes += 1;
        let incarnation = self.tcp_probes;
        let mut known: Vec<InstanceId> = self.seen_ids.iter().copied().collect();
        known.truncate(MAX_IMPERSONATED);
        // `auth` (not with a missing token), then `hello` with the proof: the right
        // token's proof for the nonce the server's next challenge will carry, a wrong
        // one's a guess.
        let mut ops = self.tcp_handshake(token.as_ref());
        let mut keys = Vec::new();
        for worker in self.workers.iter().flatten() {
            keys.extend(worker.recent_keys().into_iter().take(1));
        }
        ops.push(Op::Lookup { keys });
        ops.push(Op::Status);
        for &victim in &known {
            ops.extend(self.tcp_victim_ops(victim));
        }
        let nobody = InstanceId::new(1).expect("1 is an id");
        for op in ops {
            let id = self.adversary_id();
            let envelope = Envelope {
                slot,
                incarnation,
                instance: nobody,
                boot: self.server.boot,
                sent_at: self.now,
                exiting: false,
                channel: Channel::Main,
                uid: u32::MAX,
                same_host: false,
                secret: None,
                epoch: 0,
                tcp: true,
                payload: Payload::Op { id, op, fds: 0 },
            };
            self.send_request(envelope);
        }
        let boot = self.server.boot;
        self.agenda.push(
            self.now + MILLISECOND,
            Event::Disconnect {
                boot,
                slot,
                incarnation,
            },
        );
    }

    /// A TCP probe's `auth` (not with a missing token), then its `hello` with the proof:
    /// the right token's proof for the nonce the server's next challenge will carry, a
    /// wrong one's a guess.
    fn tcp_handshake(&mut self, token: Option<&Vec<u8>>) -> Vec<Op> {
        let mut ops = Vec::new();
        let mut proof = None;
        if let Some(token) = token {
            use kvwarden_core::protocol::tcp_auth::{TcpKey, server_nonce};
            let key = TcpKey::from_token(token);
            let mut client = [0u8; 32];
            client.copy_from_slice(&self.wrong_secret());
            ops.push(Op::Auth {
                id: key.id(),
                nonce: client,
            });
            let boot = self.server.boot;
            if self.tcp_challenges.0 != boot {
                self.tcp_challenges = (boot, 0);
            }
            if Some(token) == self.cfg.server.tcp_token.as_ref() {
                let server = server_nonce(&crate::config::SIM_NONCE_SECRET, self.tcp_challenges.1);
                self.tcp_challenges.1 += 1;
                proof = Some(key.client_proof(&client, &server).to_vec());
            } else {
                proof = Some(self.wrong_secret());
            }
        }
        ops.push(Op::Hello {
            protocol: kvwarden_core::protocol::PROTOCOL_VERSION,
            client: "tcp-probe".to_string(),
            pidfd_index: None,
            sends_fds: false,
            token: None,
            proof,
            wait_ms: None,
        });
        ops
    }

    /// What a TCP probe tries on `victim`: ping, attach, register, store, retrieve,
    /// unregister.
    fn tcp_victim_ops(&mut self, victim: InstanceId) -> Vec<Op> {
        vec![
            Op::Ping {
                instance: Some(victim),
            },
            Op::Attach {
                instance: victim,
                secret: self.wrong_secret(),
            },
            Op::RegisterKvCache {
                instance: victim,
                buffers: Vec::new(),
                model_name: "tcp-probe".to_string(),
                world_size: 1,
            },
            Op::Store {
                instance: victim,
                key: b"tcp-probe".to_vec(),
                buffer: 0,
                offset: 0,
                nbytes: 16,
            },
            Op::Retrieve {
                instance: victim,
                key: b"tcp-probe".to_vec(),
                buffer: 0,
                offset: 0,
                nbytes: STORE_BYTES,
            },
            Op::UnregisterKvCache { instance: victim },
        ]
    }

    pub(super) fn crash(&mut self, slot: usize) {
        let Some(worker) = self.workers[slot].as_mut() else {
            return;
        };
        if worker.process == ProcessState::Dead {
            return;
        }
        worker.crash();
        self.exited(slot);
        self.schedule_worker_wake(slot);
    }
}
