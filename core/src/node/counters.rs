//! The node's own counters: what `status` reports of pings, builds and the transfers
//! refused on their way (each counted where its component decides it).

/// The counts (see the module docs); each only grows.
#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Counters {
    pings: u64,
    pings_false: u64,
    contexts_built: u64,
    length_mismatches: u64,
    past_deadline: u64,
}

impl Counters {
    /// A ping received (counted before its admission: a refused one too).
    pub(super) fn ping_received(&mut self) {
        self.pings += 1;
    }

    /// A ping answered: `tracked` is its answer.
    pub(super) fn ping_answered(&mut self, tracked: bool) {
        self.pings_false += u64::from(!tracked);
    }

    /// A context built.
    pub(super) fn context_built(&mut self) {
        self.contexts_built += 1;
    }

    /// A retrieve's key held with another length than asked: a miss.
    pub(super) fn length_mismatch(&mut self) {
        self.length_mismatches += 1;
    }

    /// A copy into a worker's buffer not started: its worker had stopped waiting.
    pub(super) fn past_deadline(&mut self) {
        self.past_deadline += 1;
    }

    /// Pings received, and pings answered `false`.
    pub(super) fn pings(&self) -> (u64, u64) {
        (self.pings, self.pings_false)
    }

    /// Contexts built.
    pub(super) fn contexts_built(&self) -> u64 {
        self.contexts_built
    }

    /// Retrieves missed for a length mismatch.
    pub(super) fn length_mismatches(&self) -> u64 {
        self.length_mismatches
    }

    /// Copies not started past their worker's deadline.
    pub(super) fn copies_past_deadline(&self) -> u64 {
        self.past_deadline
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ping_answered_false_counts_in_both_and_a_refused_one_as_received() {
        let mut counters = Counters::default();
        counters.ping_received();
        counters.ping_answered(true);
        assert_eq!(counters.pings(), (1, 0), "control: a tracked ping");
        counters.ping_received();
        counters.ping_answered(false);
        assert_eq!(counters.pings(), (2, 1));
        counters.ping_received(); // refused before it was answered
        assert_eq!(counters.pings(), (3, 1));
    }
}
