//! A scenario's expectations, judged on a finished run.
//!
//! Each expectation can fail, and says so with the class of the property it states: a
//! `not_reaped` that fails is a safety failure (a live worker lost its state), a
//! `reaped` that fails is a liveness failure (a dead worker's state stayed).

use crate::time::{Nanos, as_seconds};
use crate::violation::Class;
use crate::world::{RunReport, Snapshot, WorkerSnapshot};
use kvwarden_core::InstanceId;

/// What an expectation is about.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ExpectKind {
    /// An entry of the worker was reaped (by timeout) within `between_seconds`.
    Reaped,
    /// No entry of the worker was reaped (within `between_seconds`, else ever).
    NotReaped,
    /// A context of the worker was freed with `cause` within `between_seconds`.
    Freed,
    /// No context of the worker was freed (within `between_seconds`, else ever).
    NotFreed,
    /// Live contexts of the worker (or of everyone) at `at_seconds` (else the end).
    Contexts,
    /// Contexts built for the worker over the run.
    Builds,
    /// The worker's heartbeat health at `at_seconds`.
    Healthy,
    /// The worker is alive, healthy and holds one context per module at `at_seconds`.
    Recovered,
    /// At least `min` pings answered `bad_args` (loud).
    BadArgs,
    /// At least `min` UNREGISTERs answered `false`.
    UnregisterFalse,
    /// The core reported exactly `count` stalls.
    Stalls,
    /// At least `min` engine-driven reservations or pins discarded with their context.
    ReservationsDiscarded,
    /// At least `min` frees waited for a copy still running.
    FreesDeferred,
    /// End of run: every live worker healthy with one context per module, every dead
    /// one holding nothing.
    Converged,
    /// At least `min` replies `forbidden` reached the worker (row 23).
    Forbidden,
    /// At least `min` frees reported hung by the node's watchdog (row 20).
    FreesHung,
    /// At least `min` frames refused by the real decoder, each answered (row 24).
    DecodeErrors,
    /// At least `min` L2 writes carried out (rows 27, 29).
    L2Written,
    /// At least `min` L2 reads answered with a hit.
    L2Hits,
    /// At least `min` L2 reads answered `Corrupt` (row 28).
    L2Corrupt,
    /// At least `min` L2 operations answered `Failed` or `TimedOut` (row 27).
    L2Failed,
    /// At least `min` fresh ids the worker drew because its `attach` was refused
    /// (row 31: its id was squatted).
    IdentityChanges,
    /// At least `min` `forbidden` replies on TCP connections (row 32).
    TcpForbidden,
    /// At least `min` reads answered as a miss for keys only another tenant stored
    /// (row 33).
    ForeignMisses,
    /// At least `min` values adopted by restarted servers from the pool file (row 71).
    Adopted,
    /// At least `min` reads served from values an earlier server process wrote (row 71).
    AdoptedServed,
    /// At least `min` values a restarted server dropped as torn (row 72).
    DroppedTorn,
    /// At least `min` values lost to stores that took their slot before its seal was
    /// checked (row 71).
    DroppedTaken,
}

impl ExpectKind {
    const NAMES: [(ExpectKind, &'static str); 28] = [
        (ExpectKind::Reaped, "reaped"),
        (ExpectKind::NotReaped, "not_reaped"),
        (ExpectKind::Freed, "freed"),
        (ExpectKind::NotFreed, "not_freed"),
        (ExpectKind::Contexts, "contexts"),
        (ExpectKind::Builds, "builds"),
        (ExpectKind::Healthy, "healthy"),
        (ExpectKind::Recovered, "recovered"),
        (ExpectKind::BadArgs, "bad_args"),
        (ExpectKind::UnregisterFalse, "unregister_false"),
        (ExpectKind::Stalls, "stalls"),
        (ExpectKind::ReservationsDiscarded, "reservations_discarded"),
        (ExpectKind::FreesDeferred, "frees_deferred"),
        (ExpectKind::Converged, "converged"),
        (ExpectKind::Forbidden, "forbidden"),
        (ExpectKind::FreesHung, "frees_hung"),
        (ExpectKind::DecodeErrors, "decode_errors"),
        (ExpectKind::L2Written, "l2_written"),
        (ExpectKind::L2Hits, "l2_hits"),
        (ExpectKind::L2Corrupt, "l2_corrupt"),
        (ExpectKind::L2Failed, "l2_failed"),
        (ExpectKind::IdentityChanges, "identity_changes"),
        (ExpectKind::TcpForbidden, "tcp_forbidden"),
        (ExpectKind::ForeignMisses, "foreign_misses"),
        (ExpectKind::Adopted, "adopted"),
        (ExpectKind::AdoptedServed, "adopted_served"),
        (ExpectKind::DroppedTorn, "dropped_torn"),
        (ExpectKind::DroppedTaken, "dropped_taken"),
    ];

    /// The accepted spellings, for error messages.
    pub const HELP: &'static str = "one of reaped, not_reaped, freed, not_freed, contexts, builds, healthy, recovered, bad_args, unregister_false, stalls, reservations_discarded, frees_deferred, converged, forbidden, frees_hung, decode_errors, l2_written, l2_hits, l2_corrupt, l2_failed, identity_changes, tcp_forbidden, foreign_misses, adopted, adopted_served, dropped_torn, dropped_taken";

    /// The kind spelled `name` in a scenario file.
    pub fn parse(name: &str) -> Option<ExpectKind> {
        Self::NAMES
            .iter()
            .find(|(_, n)| *n == name)
            .map(|(k, _)| *k)
    }

    /// The file spelling.
    pub fn label(self) -> &'static str {
        Self::NAMES
            .iter()
            .find(|(k, _)| *k == self)
            .map(|(_, n)| *n)
            .unwrap_or("?")
    }

    /// Whether `worker` is required.
    pub fn needs_worker(self) -> bool {
        matches!(
            self,
            ExpectKind::Reaped
                | ExpectKind::Freed
                | ExpectKind::Builds
                | ExpectKind::Healthy
                | ExpectKind::Recovered
                | ExpectKind::BadArgs
                | ExpectKind::UnregisterFalse
                | ExpectKind::Forbidden
                | ExpectKind::IdentityChanges
        )
    }

    /// Whether `count` is required.
    pub fn needs_count(self) -> bool {
        matches!(
            self,
            ExpectKind::Contexts | ExpectKind::Builds | ExpectKind::Stalls
        )
    }
}

/// Which worker an expectation names.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ExpectTarget {
    /// Every worker (or the whole server).
    All,
    /// One slot; one incarnation of it, or (None) every incarnation for history and the
    /// current process for state.
    Worker {
        /// The slot.
        slot: usize,
        /// The process number in the slot.
        incarnation: Option<u32>,
    },
}

/// One `[[expect]]` table.
#[derive(Clone, Debug)]
pub struct Expectation {
    /// Its index in the file.
    pub index: usize,
    /// What it checks.
    pub kind: ExpectKind,
    /// Whom.
    pub target: ExpectTarget,
    /// Absolute window in virtual time.
    pub between: Option<(Nanos, Nanos)>,
    /// Checkpoint (None: the end).
    pub at: Option<Nanos>,
    /// Exact count.
    pub count: Option<u64>,
    /// Lower bound.
    pub min: Option<u64>,
    /// Boolean value.
    pub value: Option<bool>,
    /// Free cause label (None: any).
    pub cause: Option<String>,
}

/// An expectation that did not hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpectFailure {
    /// The class of the property it states.
    pub class: Class,
    /// What was expected and what was seen.
    pub detail: String,
}

/// The checkpoints a list of expectations needs, in order of the expectations.
pub fn checkpoints(expectations: &[Expectation]) -> Vec<Nanos> {
    expectations.iter().filter_map(|e| e.at).collect()
}

/// Judges every expectation on `report`; `checkpoints` came from [`checkpoints`].
pub fn judge(expectations: &[Expectation], report: &RunReport) -> Vec<ExpectFailure> {
    let mut failures = Vec::new();
    let mut checkpoint = 0;
    for expectation in expectations {
        let snapshot = if expectation.at.is_some() {
            checkpoint += 1;
            &report.checkpoints[checkpoint - 1]
        } else {
            &report.last
        };
        if let Err(failure) = judge_one(expectation, report, snapshot) {
            failures.push(failure);
        }
    }
    failures
}

fn instances(expectation: &Expectation, report: &RunReport) -> Vec<InstanceId> {
    match expectation.target {
        ExpectTarget::All => report
            .instances
            .iter()
            .flatten()
            .flatten()
            .copied()
            .collect(),
        ExpectTarget::Worker { slot, incarnation } => report.ids(slot, incarnation),
    }
}

fn current<'a>(
    expectation: &Expectation,
    snapshot: &'a Snapshot,
    report: &RunReport,
) -> Option<&'a WorkerSnapshot> {
    match expectation.target {
        ExpectTarget::All => None,
        ExpectTarget::Worker { slot, incarnation } => {
            let instance = report.instance(slot, incarnation)?;
            snapshot.workers.iter().find(|w| w.instance == instance)
        }
    }
}

fn in_window(expectation: &Expectation, at: Nanos) -> bool {
    expectation.between.is_none_or(|(a, b)| a <= at && at <= b)
}

fn window_text(expectation: &Expectation) -> String {
    match expectation.between {
        None => "during the run".to_string(),
        Some((a, b)) => format!("between {:.3}s and {:.3}s", as_seconds(a), as_seconds(b)),
    }
}

fn times(list: &[Nanos]) -> String {
    let shown: Vec<String> = list
        .iter()
        .take(5)
        .map(|t| format!("{:.3}s", as_seconds(*t)))
        .collect();
    if shown.is_empty() {
        "never".to_string()
    } else {
        shown.join(", ")
    }
}

fn judge_one(
    e: &Expectation,
    report: &RunReport,
    snapshot: &Snapshot,
) -> Result<(), ExpectFailure> {
    let fail = |class: Class, detail: String| {
        Err(ExpectFailure {
            class,
            detail: format!("expect[{}] ({}): {detail}", e.index, e.kind.label()),
        })
    };
    let ids = instances(e, report);
    let who = match e.target {
        ExpectTarget::All => "any worker".to_string(),
        ExpectTarget::Worker { slot, incarnation } => match incarnation {
            Some(n) => format!("w{slot}#{n}"),
            None => format!("w{slot}"),
        },
    };
    let reaps: Vec<Nanos> = report
        .reaps
        .iter()
        .filter(|(i, _)| ids.contains(i))
        .map(|&(_, t)| t)
        .collect();
    let frees: Vec<Nanos> = report
        .frees
        .iter()
        .filter(|(_, r)| ids.contains(&r.instance))
        .filter(|(_, r)| e.cause.as_deref().is_none_or(|c| c == r.cause.label()))
        .map(|&(t, _)| t)
        .collect();
    let judged = judge_times(e, &who, &reaps, &frees)
        .and_then(|()| judge_state(e, &who, report, snapshot, &ids))
        .and_then(|()| judge_health(e, &who, report, snapshot))
        .and_then(|()| judge_counts(e, &who, report, snapshot));
    match judged {
        Ok(()) => Ok(()), // Converged: judged by the run itself (`not_converged`)
        Err((class, detail)) => fail(class, detail),
    }
}

/// A failed expectation's class and what it saw.
type Judged = Result<(), (Class, String)>;

/// Expectations about when an instance was reaped or lost a context.
fn judge_times(e: &Expectation, who: &str, reaps: &[Nanos], frees: &[Nanos]) -> Judged {
    match e.kind {
        ExpectKind::Reaped => {
            if let Some((a, _)) = e.between
                && let Some(&early) = reaps.iter().find(|&&t| t < a)
            {
                return Err((
                    Class::Safety,
                    format!(
                        "{who} was reaped at {:.3}s, before {:.3}s",
                        as_seconds(early),
                        as_seconds(a)
                    ),
                ));
            }
            if !reaps.iter().any(|&t| in_window(e, t)) {
                return Err((
                    Class::Liveness,
                    format!(
                        "{who} was not reaped {}; reaps: {}",
                        window_text(e),
                        times(reaps)
                    ),
                ));
            }
        }
        ExpectKind::NotReaped => {
            let inside: Vec<Nanos> = reaps.iter().copied().filter(|&t| in_window(e, t)).collect();
            if !inside.is_empty() {
                return Err((
                    Class::Safety,
                    format!(
                        "{who} was reaped at {} ({})",
                        times(&inside),
                        window_text(e)
                    ),
                ));
            }
        }
        ExpectKind::Freed if !frees.iter().any(|&t| in_window(e, t)) => {
            let cause = e.cause.as_deref().unwrap_or("any");
            return Err((
                Class::Liveness,
                format!(
                    "no context of {who} freed (cause {cause}) {}; such frees: {}",
                    window_text(e),
                    times(frees)
                ),
            ));
        }
        ExpectKind::NotFreed => {
            let inside: Vec<Nanos> = frees.iter().copied().filter(|&t| in_window(e, t)).collect();
            if !inside.is_empty() {
                return Err((
                    Class::Safety,
                    format!(
                        "{who} lost a context at {} ({})",
                        times(&inside),
                        window_text(e)
                    ),
                ));
            }
        }
        _ => {}
    }
    Ok(())
}

/// Expectations about what a worker holds or is at the snapshot.
fn judge_state(
    e: &Expectation,
    who: &str,
    report: &RunReport,
    snapshot: &Snapshot,
    ids: &[InstanceId],
) -> Judged {
    match e.kind {
        ExpectKind::Contexts => {
            let want = e.count.unwrap_or(0);
            let have = match e.target {
                ExpectTarget::All => snapshot.live_contexts,
                ExpectTarget::Worker { .. } => {
                    current(e, snapshot, report).map_or(0, |w| u64::from(w.contexts))
                }
            };
            if have != want {
                let class = if have > want {
                    Class::Safety
                } else {
                    Class::Liveness
                };
                return Err((
                    class,
                    format!(
                        "{who} holds {have} live contexts at {:.3}s, expected {want}",
                        as_seconds(snapshot.at)
                    ),
                ));
            }
        }
        ExpectKind::Builds => {
            let want = e.count.unwrap_or(0);
            let have: u64 = ids
                .iter()
                .map(|i| report.builds.get(i).copied().unwrap_or(0))
                .sum();
            if have != want {
                let class = if have > want {
                    Class::Safety
                } else {
                    Class::Liveness
                };
                return Err((
                    class,
                    format!("{have} contexts were built for {who}, expected {want}"),
                ));
            }
        }
        _ => {}
    }
    Ok(())
}

/// Expectations about a worker's health at the snapshot.
fn judge_health(e: &Expectation, who: &str, report: &RunReport, snapshot: &Snapshot) -> Judged {
    match e.kind {
        ExpectKind::Healthy => {
            let want = e.value.unwrap_or(true);
            let have = current(e, snapshot, report).map(|w| w.healthy);
            if have != Some(want) {
                return Err((
                    Class::Liveness,
                    format!(
                        "{who} health at {:.3}s is {have:?}, expected {want}",
                        as_seconds(snapshot.at)
                    ),
                ));
            }
        }
        ExpectKind::Recovered => {
            let Some(worker) = current(e, snapshot, report) else {
                return Err((
                    Class::Liveness,
                    format!("{who} has no process at {:.3}s", as_seconds(snapshot.at)),
                ));
            };
            if !(worker.alive && worker.healthy && worker.one_per_module) {
                return Err((
                    Class::Liveness,
                    format!(
                        "{who} at {:.3}s: alive {}, healthy {}, {} live contexts (one per module: {})",
                        as_seconds(snapshot.at),
                        worker.alive,
                        worker.healthy,
                        worker.contexts,
                        worker.one_per_module
                    ),
                ));
            }
        }
        _ => {}
    }
    Ok(())
}

/// Expectations about how often something was seen: at least `min`, or exactly a count.
fn judge_counts(e: &Expectation, who: &str, report: &RunReport, snapshot: &Snapshot) -> Judged {
    match e.kind {
        ExpectKind::BadArgs
        | ExpectKind::UnregisterFalse
        | ExpectKind::Forbidden
        | ExpectKind::IdentityChanges => {
            let min = e.min.unwrap_or(1);
            let have = current(e, snapshot, report).map_or(0, |w| match e.kind {
                ExpectKind::BadArgs => w.stats.bad_args_replies,
                ExpectKind::Forbidden => w.stats.forbidden_replies,
                ExpectKind::IdentityChanges => w.stats.identity_changes,
                _ => w.stats.unregister_false,
            });
            if have < min {
                return Err((
                    Class::Liveness,
                    format!("{who} saw {have}, expected at least {min}"),
                ));
            }
        }
        ExpectKind::Stalls => {
            let want = e.count.unwrap_or(0);
            if snapshot.server.stalls != want {
                return Err((
                    Class::Liveness,
                    format!(
                        "the core reported {} stalls, expected {want}",
                        snapshot.server.stalls
                    ),
                ));
            }
        }
        ExpectKind::ReservationsDiscarded
        | ExpectKind::FreesDeferred
        | ExpectKind::FreesHung
        | ExpectKind::DecodeErrors
        | ExpectKind::L2Written
        | ExpectKind::L2Hits
        | ExpectKind::L2Corrupt
        | ExpectKind::L2Failed
        | ExpectKind::TcpForbidden
        | ExpectKind::ForeignMisses
        | ExpectKind::Adopted
        | ExpectKind::AdoptedServed
        | ExpectKind::DroppedTorn
        | ExpectKind::DroppedTaken => {
            let min = e.min.unwrap_or(1);
            let have = match e.kind {
                ExpectKind::Adopted => snapshot.server.adopted,
                ExpectKind::AdoptedServed => snapshot.server.adopted_served,
                ExpectKind::DroppedTorn => snapshot.server.dropped_torn,
                ExpectKind::DroppedTaken => snapshot.server.dropped_taken,
                ExpectKind::TcpForbidden => snapshot.server.tcp_forbidden,
                ExpectKind::ForeignMisses => snapshot.server.foreign_misses,
                ExpectKind::L2Written => snapshot.server.l2_written,
                ExpectKind::L2Hits => snapshot.server.l2_hits,
                ExpectKind::L2Corrupt => snapshot.server.l2_corrupt,
                ExpectKind::L2Failed => snapshot.server.l2_failed,
                ExpectKind::ReservationsDiscarded => snapshot.server.reservations_discarded,
                ExpectKind::FreesDeferred => snapshot.server.frees_deferred,
                ExpectKind::FreesHung => snapshot.server.frees_hung,
                _ => snapshot.server.decode_errors,
            };
            if have < min {
                return Err((
                    Class::Liveness,
                    format!("saw {have}, expected at least {min}"),
                ));
            }
        }
        _ => {}
    }
    Ok(())
}
