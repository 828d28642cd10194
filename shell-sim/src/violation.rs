//! What a failed run reports: which invariant broke, when, and the class of failure
//! that decides the exit code.

use crate::time::{Nanos, as_seconds};

/// The kind of failure, as the exit code tells it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Class {
    /// A panic in the simulator or the core, or an internal assertion (the model and
    /// the core disagree about what happened). Exit code 127.
    Internal,
    /// Something that must happen did not (a reap too late, a leak at the end, no
    /// convergence). Exit code 128.
    Liveness,
    /// Something that must never happen did (a live worker reaped, a context freed
    /// twice, a ghost). Exit code 129.
    Safety,
}

impl Class {
    /// The process exit code for this class.
    pub fn exit_code(self) -> i32 {
        match self {
            Class::Internal => 127,
            Class::Liveness => 128,
            Class::Safety => 129,
        }
    }

    /// `internal`, `liveness` or `safety`.
    pub fn label(self) -> &'static str {
        match self {
            Class::Internal => "internal",
            Class::Liveness => "liveness",
            Class::Safety => "safety",
        }
    }
}

/// The first broken invariant of a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// Its class.
    pub class: Class,
    /// The invariant's stable name, e.g. `reaped_early`.
    pub invariant: &'static str,
    /// Virtual time it was seen.
    pub at: Nanos,
    /// What was seen and what was required, with ids and figures.
    pub detail: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} violation `{}` at t={:.6}s: {}",
            self.class.label(),
            self.invariant,
            as_seconds(self.at),
            self.detail
        )
    }
}
