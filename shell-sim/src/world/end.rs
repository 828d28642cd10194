//! Snapshots for expectations, and the end-of-run checks: no leak once G + R has passed,
//! and (for swarms) convergence.

use super::{Snapshot, WorkerSnapshot, World};
use crate::server::ServerState;
use crate::time::{Nanos, SECOND, as_seconds};
use crate::violation::Class;
use crate::worker::ProcessState;
use kvwarden_core::InstanceId;

impl World {
    pub(super) fn snapshot(&self) -> Snapshot {
        let workers = self
            .workers
            .iter()
            .flatten()
            .map(|worker| {
                let one_per_module = worker.spec().modules.iter().all(|&m| {
                    self.checker.live_contexts_of((worker.instance, m)) == 1
                        && self
                            .checker
                            .shadow()
                            .get((worker.instance, m))
                            .is_some_and(|e| e.building.is_none())
                });
                WorkerSnapshot {
                    instance: worker.instance,
                    incarnation: worker.incarnation,
                    healthy: worker.is_healthy(),
                    alive: worker.process != ProcessState::Dead,
                    contexts: self.checker.live_contexts(worker.instance),
                    one_per_module,
                    stats: worker.stats.clone(),
                }
            })
            .collect();
        Snapshot {
            at: self.now,
            workers,
            live_contexts: self.checker.live_total(),
            entries: self.checker.shadow().len(),
            server: self.server.stats.clone(),
        }
    }

    /// The longest a dead instance's state may legitimately outlive it: G + R, plus a
    /// message still on the wire, a build still running, the exit notice, and every
    /// pause the server spent (a paused server reaps nobody).
    fn leak_allowance(&self) -> Nanos {
        let spec = &self.cfg.server;
        spec.registration_grace
            + spec.resolution
            + self.max_link_delay
            + spec.build_delay.1
            + spec.exit_notice_delay
            + spec.copy_duration
            + SECOND
    }

    pub(super) fn check_end(&mut self) {
        if !self.server.is_turning() || self.server.state != ServerState::Up {
            return; // a paused, down or stopped server cannot be judged on leaks
        }
        let allowance = self.leak_allowance();
        let now_c = self.checker.corrected_now(self.now);
        let mut gone: Vec<(InstanceId, Nanos)> = self.gone.iter().map(|(&i, &t)| (i, t)).collect();
        gone.sort();
        let reaping = self.cfg.server.reap_timeout > 0;
        for (instance, at) in gone {
            if !reaping || now_c.saturating_sub(self.checker.corrected_at(at)) <= allowance {
                continue;
            }
            let contexts = self.checker.live_contexts(instance);
            if contexts > 0 || self.checker.shadow().holds(instance) {
                let name = self.name_of(instance);
                self.checker.fail(
                    Class::Liveness,
                    "leak_at_end",
                    format!(
                        "{name} (instance {instance}) has been gone since t={:.3}s, longer \
                         than G + R and every delay in flight, yet holds {contexts} live \
                         contexts and an entry: {}",
                        as_seconds(at),
                        self.checker.shadow().holds(instance)
                    ),
                );
                return;
            }
        }
        if !self.cfg.converge_at_end {
            return;
        }
        for slot in 0..self.workers.len() {
            let Some(worker) = self.workers[slot].as_ref() else {
                continue;
            };
            if worker.process != ProcessState::Running
                || worker.is_shutting_down()
                || worker.spec().legacy_ping
            {
                continue;
            }
            let instance = worker.instance;
            let healthy = worker.is_healthy();
            let modules = worker.spec().modules.clone();
            let counts: Vec<u32> = modules
                .iter()
                .map(|&m| self.checker.live_contexts_of((instance, m)))
                .collect();
            if !healthy || counts.iter().any(|&n| n != 1) {
                let name = self.cfg.workers[slot].name.clone();
                self.checker.fail(
                    Class::Liveness,
                    "not_converged",
                    format!(
                        "after the final heal {name} (instance {instance}) is {} and holds \
                         {counts:?} live contexts in {:?}; every live worker must be healthy \
                         with exactly one context per module",
                        if healthy { "healthy" } else { "unhealthy" },
                        modules.iter().map(|m| m.label()).collect::<Vec<_>>()
                    ),
                );
                return;
            }
        }
    }
}
