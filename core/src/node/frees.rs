//! Frees and their watchdog: every free sent to the shell, when it started (on the
//! stall-corrected clock: a server pause is not time a free ran), which ones ran past
//! the watchdog (reported once each), and how many frees were started, by label.

use super::{BTreeMap, FreeId, InstanceId, Instant, Module, Note};
use std::time::Duration;

struct Running {
    instance: InstanceId,
    module: Module,
    started: Instant,
    reported: bool,
}

/// The frees the shell is running, and the counts of every free started.
#[derive(Default)]
pub(super) struct Frees {
    running: BTreeMap<FreeId, Running>,
    started_by_label: BTreeMap<&'static str, u64>,
    hung_total: u64,
}

impl Frees {
    /// A free was decided, labelled `label` (the cause's, or `shutdown`): counted once,
    /// however many jobs carry it out.
    pub(super) fn count(&mut self, label: &'static str) {
        *self.started_by_label.entry(label).or_default() += 1;
    }

    /// The shell runs free `free` from `now`.
    pub(super) fn started(
        &mut self,
        free: FreeId,
        instance: InstanceId,
        module: Module,
        now: Instant,
    ) {
        let running = Running {
            instance,
            module,
            started: now,
            reported: false,
        };
        self.running.insert(free, running);
    }

    /// `free` is done; a note when it had been reported hung.
    pub(super) fn done(&mut self, free: FreeId, now: Instant) -> Option<Note> {
        let running = self.running.remove(&free)?;
        running.reported.then(|| Note::FreeFinishedLate {
            instance: running.instance,
            module: running.module,
            after: now.saturating_duration_since(running.started),
        })
    }

    /// The server was paused for `gap` before `now`: frees that started before it did
    /// not run meanwhile.
    pub(super) fn credit_stall(&mut self, now: Instant, gap: Duration) {
        for running in self.running.values_mut() {
            if now.saturating_duration_since(running.started) >= gap {
                running.started = running.started + gap;
            }
        }
    }

    /// Frees running `watchdog` or longer and not reported yet: reported now (counted).
    pub(super) fn newly_hung(&mut self, now: Instant, watchdog: Duration) -> Vec<Note> {
        let mut hung = Vec::new();
        for running in self.running.values_mut() {
            if !running.reported && now.saturating_duration_since(running.started) >= watchdog {
                running.reported = true;
                hung.push(Note::FreeHung {
                    instance: running.instance,
                    module: running.module,
                    watchdog,
                });
            }
        }
        self.hung_total += hung.len() as u64;
        hung
    }

    /// When the next unreported free reaches `watchdog`.
    pub(super) fn next_deadline(&self, watchdog: Duration) -> Option<Instant> {
        self.running
            .values()
            .filter(|running| !running.reported)
            .map(|running| running.started + watchdog)
            .min()
    }

    /// Frees the shell is running.
    pub(super) fn running(&self) -> usize {
        self.running.len()
    }

    /// Frees started, by label.
    pub(super) fn started_by_label(&self) -> &BTreeMap<&'static str, u64> {
        &self.started_by_label
    }

    /// Frees reported hung since start.
    pub(super) fn hung_total(&self) -> u64 {
        self.hung_total
    }
}
