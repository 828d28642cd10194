//! What faults do to a worker process: SIGKILL, SIGSTOP and SIGCONT, a starved
//! heartbeat, a clean stop, unregistering, and an identity changed after a refused
//! `attach`.

use super::{Outbox, Pending, ProcessState, Purpose, Shutdown, Worker, chunk_key, unregister_op};
use crate::time::Nanos;
use kvwarden_core::InstanceId;

impl Worker {
    /// SIGKILL.
    pub fn crash(&mut self) {
        self.process = ProcessState::Dead;
    }

    /// SIGSTOP.
    pub fn freeze(&mut self) {
        if self.process == ProcessState::Running {
            self.process = ProcessState::Frozen;
        }
    }

    /// SIGCONT: held replies first, then every timer that came due meanwhile.
    pub fn thaw(&mut self, now: Nanos, out: &mut Outbox) {
        if self.process != ProcessState::Frozen {
            return;
        }
        self.process = ProcessState::Running;
        for (request_id, result) in std::mem::take(&mut self.held_replies) {
            self.handle_reply(now, request_id, result, out);
        }
        self.on_wake(now, out);
    }

    /// The heartbeat thread stops getting CPU.
    pub fn starve(&mut self) {
        self.starved = true;
    }

    /// The heartbeat thread runs again.
    pub fn feed(&mut self, now: Nanos, out: &mut Outbox) {
        self.starved = false;
        self.on_wake(now, out);
    }

    /// Clean shutdown: stop the heartbeat first (a cycle in flight neither recovers
    /// nor changes health), stop traffic, drain, then UNREGISTER (see `Shutdown`).
    pub fn stop(&mut self, now: Nanos, out: &mut Outbox) {
        if self.shutdown.is_some() || self.process == ProcessState::Dead {
            return;
        }
        self.heartbeat.stop();
        self.round = None;
        self.retry_initial_at = None;
        self.next_traffic = None;
        self.commits.clear();
        self.shutdown = Some(Shutdown::Draining {
            until: self.last_request_deadline.max(now),
        });
        self.advance_shutdown(now, out);
    }

    pub(super) fn advance_shutdown(&mut self, now: Nanos, out: &mut Outbox) {
        match &self.shutdown {
            Some(Shutdown::Draining { until }) if now >= *until => {
                let modules = self.spec.modules.clone();
                for &module in &modules {
                    let op = unregister_op(self.instance, module);
                    self.send(now, Pending::Unregister { module }, op, out);
                }
                self.shutdown = Some(Shutdown::Unregistering {
                    pending: modules,
                    until: now + self.spec.heartbeat_interval,
                });
            }
            Some(Shutdown::Unregistering { pending, until })
                if pending.is_empty() || now >= *until =>
            {
                self.process = ProcessState::Dead;
                out.exited = true;
            }
            _ => {}
        }
    }

    /// An operator-driven UNREGISTER of every module, the process carrying on (row 14).
    pub fn unregister_all(&mut self, now: Nanos, out: &mut Outbox) {
        if self.process != ProcessState::Running || self.shutdown.is_some() {
            return;
        }
        for module in self.spec.modules.clone() {
            let op = unregister_op(self.instance, module);
            self.send(now, Pending::Unregister { module }, op, out);
        }
    }

    /// One transfer on each module now, outside the traffic schedule.
    pub fn transfer_once(&mut self, now: Nanos, out: &mut Outbox) {
        if self.process != ProcessState::Running || self.shutdown.is_some() {
            return;
        }
        let next = self.next_traffic;
        self.transfer_all(now, out);
        self.next_traffic = next;
    }

    /// An extra REGISTER of every module under the same id (row 15).
    pub fn register_again(&mut self, now: Nanos, out: &mut Outbox) {
        if self.process != ProcessState::Running || self.shutdown.is_some() || self.round.is_some()
        {
            return;
        }
        self.begin_round(now, Purpose::Reregister, out);
    }
}

impl Worker {
    /// Its `attach` was refused: the process draws a fresh id and secret (the world
    /// gives them), reconnects (a new connection attaches them first), and registers
    /// again under them: a round now, or the one it was running, restarted (row 31).
    pub fn change_identity(
        &mut self,
        now: Nanos,
        instance: InstanceId,
        secret: [u8; 32],
        out: &mut Outbox,
    ) {
        self.instance = instance;
        self.secret = secret;
        self.epoch += 1;
        self.stats.identity_changes += 1;
        self.last_stored = None;
        self.commits.clear();
        if self.process != ProcessState::Running || self.shutdown.is_some() {
            return;
        }
        match self.round.as_ref().map(|round| round.purpose) {
            Some(purpose) => self.begin_round(now, purpose, out),
            None if self.registered_once => self.begin_round(now, Purpose::Reregister, out),
            None => {} // the initial round's retry registers under the new id
        }
    }

    /// The keys this process stored last and will store next (a chunk's key is a
    /// function of what it holds, so another tenant can compute them: row 33).
    pub fn recent_keys(&self) -> Vec<Vec<u8>> {
        let mut keys: Vec<Vec<u8>> = self.last_stored.iter().cloned().collect();
        for serial in self.op_serial + 1..=self.op_serial + 4 {
            keys.push(chunk_key(self.instance, serial));
            keys.push(chunk_key(self.instance, serial | 1 << 63));
        }
        keys
    }
}
