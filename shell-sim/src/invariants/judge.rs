//! The judgments that end a step: a reap against the reference model (`reaped_early`,
//! `live_worker_reaped`, `reaped_in_part`, `reaped_while_disabled`), the ledger after
//! the shell's outputs, and entries past their deadline (`reap_late`).

use super::{Checker, ContextState, ShellView};
use crate::oracle::EntryKey;
use crate::time::{Nanos, as_seconds};
use crate::violation::Class;
use kvwarden_core::Module;

impl Checker {
    pub(super) fn judge_reap(&mut self, key: EntryKey, reported: Option<(Nanos, bool)>) {
        let Some(entry) = self.shadow.remove(key) else {
            self.diverged(format!(
                "the core reaped {key:?}, which the reference model does not hold"
            ));
            return;
        };
        let now_c = self.clock.now(self.now);
        let window = self.shadow.window(&entry);
        let silence = now_c.saturating_sub(entry.last_seen);
        let (instance, module) = key;
        self.reaped_now.push(instance);
        if self.shadow.reap_timeout == 0 {
            self.fail(
                Class::Safety,
                "reaped_while_disabled",
                format!(
                    "instance {instance} ({}) reaped with reaping disabled",
                    module.label()
                ),
            );
            return;
        }
        if silence <= window {
            self.fail(
                Class::Safety,
                "reaped_early",
                format!(
                    "instance {instance} ({}) reaped after {:.6}s of stall-corrected silence, \
                     not more than its window of {:.3}s (proven: {})",
                    module.label(),
                    as_seconds(silence),
                    as_seconds(window),
                    entry.proven
                ),
            );
            return;
        }
        if self.reaped_live(key, window, now_c) {
            return;
        }
        // A pause too short to count as a stall still kept the loop from reaping.
        let lateness = silence - window;
        let excused = self
            .clock
            .short_pause_within(self.now.saturating_sub(lateness), self.now);
        if lateness > self.resolution + excused {
            self.fail(
                Class::Liveness,
                "reap_late",
                format!(
                    "instance {instance} ({}) reaped {:.6}s past its deadline; target C5 allows \
                     at most the resolution {:.3}s",
                    module.label(),
                    as_seconds(lateness),
                    as_seconds(self.resolution)
                ),
            );
        }
        if let Some((reported_silence, reported_proven)) = reported
            && (reported_silence != silence || reported_proven != entry.proven)
        {
            self.diverged(format!(
                "reap of {key:?} reported silence {:.9}s proven {reported_proven}, the \
                 reference model has {:.9}s proven {}",
                as_seconds(reported_silence),
                as_seconds(silence),
                entry.proven
            ));
        }
    }

    /// `live_worker_reaped`: evidence of the instance (any module) reached the server
    /// within its window before the reap. True when it did (and the run failed).
    fn reaped_live(&mut self, key: EntryKey, window: Nanos, now_c: Nanos) -> bool {
        let (instance, module) = key;
        // Evidence of any module counts for the whole instance.
        let evidence = Module::ALL
            .iter()
            .map(|&m| self.module_arrivals.get(&(instance, m)).copied())
            .chain([self.ping_arrivals.get(&instance).copied()])
            .flatten()
            .max();
        if let Some(arrived) = evidence {
            let evidence_silence = now_c.saturating_sub(self.clock.at(arrived));
            if evidence_silence <= window {
                self.fail(
                    Class::Safety,
                    "live_worker_reaped",
                    format!(
                        "instance {instance} ({}) reaped although its last ping, register \
                         or transfer reached the server at t={:.6}s, {:.6}s (stall-corrected) \
                         before, within its window of {:.3}s",
                        module.label(),
                        as_seconds(arrived),
                        as_seconds(evidence_silence),
                        as_seconds(window)
                    ),
                );
                return true;
            }
        }
        false
    }

    pub(super) fn diverged(&mut self, detail: String) {
        self.fail(Class::Internal, "core_diverged", detail);
    }

    // ----- per-step checks -----

    /// After the server drained every effect: the per-step invariants on what the step
    /// touched.
    pub fn end_step(&mut self, shell: &ShellView<'_>) {
        let mut reaped = std::mem::take(&mut self.reaped_now);
        reaped.dedup();
        for instance in reaped {
            if self.shadow.holds(instance) {
                let left: Vec<&str> = Module::ALL
                    .iter()
                    .filter(|&&m| self.shadow.get((instance, m)).is_some())
                    .map(|m| m.label())
                    .collect();
                self.fail(
                    Class::Safety,
                    "reaped_in_part",
                    format!(
                        "instance {instance} was reaped but still holds its {} entry: an \
                         instance lives and dies whole",
                        left.join(" and ")
                    ),
                );
            }
        }
        for key in std::mem::take(&mut self.touched_keys) {
            self.judge_contexts(key);
        }
        for instance in std::mem::take(&mut self.touched_instances) {
            if shell.blend.contains(&instance) && !self.shadow.holds(instance) {
                self.fail(
                    Class::Safety,
                    "blend_without_entry",
                    format!("instance {instance} has blend state but no entry in any module"),
                );
            }
            for module in Module::ALL {
                let key = (instance, module);
                if self.live_contexts_of(key) > 0
                    && self.shadow.get(key).is_none()
                    && !self.copies_per_key.contains_key(&key)
                {
                    self.fail(
                        Class::Liveness,
                        "context_leaked",
                        format!(
                            "instance {instance} ({}) has no entry any more, yet its context \
                             was never given back for a free and no copy uses it",
                            module.label()
                        ),
                    );
                }
            }
        }
        self.released_now.clear();
        if shell.l1_held > shell.l1_explained {
            self.fail(
                Class::Safety,
                "pin_of_freed_instance",
                format!(
                    "the node holds {} L1 slots reserved or pinned, but live contexts' \
                     reservations and the copies running explain only {}: a freed \
                     context's reservations or pins remain",
                    shell.l1_held, shell.l1_explained
                ),
            );
        }
    }

    /// `two_contexts`: one (instance, module) holds at most one live context, the
    /// contexts waiting for their copies (their entry gone) aside.
    fn judge_contexts(&mut self, key: EntryKey) {
        let mut live = self.live_contexts_of(key);
        if live > 1 {
            // A context whose entry went while a copy used it waits for the copy
            // (its free is deferred): nobody holds it, whatever was built since.
            let current = self
                .shadow
                .get(key)
                .and_then(|_| self.entry_context.get(&key).copied());
            let waiting = self
                .contexts
                .iter()
                .enumerate()
                .filter(|(id, r)| {
                    (r.instance, r.module) == key
                        && r.state == ContextState::Live
                        && r.copies > 0
                        && Some(*id as u64) != current
                })
                .count() as u32;
            live -= waiting;
        }
        if live > 1 {
            self.fail(
                Class::Safety,
                "two_contexts",
                format!(
                    "instance {} holds {live} live contexts in {}",
                    key.0,
                    key.1.label()
                ),
            );
        }
    }

    /// Between steps, while the server runs: no entry may outlive its deadline by more
    /// than R (target C5), judged on the corrected clock.
    pub fn check_overdue(&mut self, now: Nanos) {
        if self.violation.is_some() {
            return;
        }
        let now_c = self.clock.now(now);
        if let Some((deadline, (instance, module))) = self.shadow.earliest_deadline()
            && deadline + self.resolution < now_c
        {
            self.now = now;
            self.fail(
                Class::Liveness,
                "reap_late",
                format!(
                    "instance {instance} ({}) is still held {:.6}s (stall-corrected) past its \
                     reap deadline; target C5 allows at most the resolution {:.3}s",
                    module.label(),
                    as_seconds(now_c - deadline),
                    as_seconds(self.resolution)
                ),
            );
        }
    }
}
