//! What L2 did, counted: the figures `/status` and `/metrics` show under `l2`.

use super::health::OpResult;

/// How one L2 read ended.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum ReadOutcome {
    /// A whole value of this format: served.
    Hit,
    /// No such key.
    Absent,
    /// A value that failed a check of its header (deleted after the read).
    Corrupt,
    /// No answer within the L2 timeout.
    TimedOut,
    /// Redis answered with an error, or the connection failed.
    Failed,
}

impl ReadOutcome {
    /// What the breaker makes of it: Redis answering at all is a success.
    pub fn op_result(self) -> OpResult {
        match self {
            ReadOutcome::Hit | ReadOutcome::Absent | ReadOutcome::Corrupt => OpResult::Succeeded,
            ReadOutcome::TimedOut => OpResult::TimedOut,
            ReadOutcome::Failed => OpResult::Failed,
        }
    }
}

/// How one L2 write ended.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum WriteOutcome {
    /// Redis stored it.
    Written,
    /// No answer within the L2 timeout; it may or may not have been stored (a reader
    /// checks the header either way).
    TimedOut,
    /// Redis answered with an error, or the connection failed.
    Failed,
}

impl WriteOutcome {
    /// What the breaker makes of it.
    pub fn op_result(self) -> OpResult {
        match self {
            WriteOutcome::Written => OpResult::Succeeded,
            WriteOutcome::TimedOut => OpResult::TimedOut,
            WriteOutcome::Failed => OpResult::Failed,
        }
    }
}

/// The L2 counters. All but `queue_bytes` only grow.
#[derive(
    Copy, Clone, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct L2Counters {
    /// Values written.
    pub writes: u64,
    /// Writes not attempted: the queue was full, or L2 was down.
    pub write_drops: u64,
    /// Reads served from L2.
    pub hits: u64,
    /// Reads that were not hits, whatever the reason (absent, corrupt, timed out,
    /// failed, or not asked because L2 was down).
    pub misses: u64,
    /// Values that failed a check of their header (each also a miss).
    pub corrupt: u64,
    /// Operations, reads and writes, with no answer within the timeout.
    pub timeouts: u64,
    /// Operations, reads and writes, that Redis or the connection failed.
    pub errors: u64,
    /// Bytes in the write-behind queue now, waiting or being written.
    pub queue_bytes: u64,
}

impl L2Counters {
    /// Counts a read.
    pub fn record_read(&mut self, outcome: ReadOutcome) {
        match outcome {
            ReadOutcome::Hit => self.hits += 1,
            ReadOutcome::Absent => self.misses += 1,
            ReadOutcome::Corrupt => {
                self.misses += 1;
                self.corrupt += 1;
            }
            ReadOutcome::TimedOut => {
                self.misses += 1;
                self.timeouts += 1;
            }
            ReadOutcome::Failed => {
                self.misses += 1;
                self.errors += 1;
            }
        }
    }

    /// Counts a read not asked because the breaker is open: a miss with no other cause.
    pub fn record_skipped_read(&mut self) {
        self.misses += 1;
    }

    /// Counts a write not attempted (queue full, or the breaker open).
    pub fn record_dropped_write(&mut self) {
        self.write_drops += 1;
    }

    /// Counts a write that was attempted.
    pub fn record_write(&mut self, outcome: WriteOutcome) {
        match outcome {
            WriteOutcome::Written => self.writes += 1,
            WriteOutcome::TimedOut => self.timeouts += 1,
            WriteOutcome::Failed => self.errors += 1,
        }
    }

    /// Counts a probe of existence (`lookup`) that got no answer: no hit or miss, only
    /// the cause.
    pub fn record_failed_probe(&mut self, result: OpResult) {
        match result {
            OpResult::Succeeded => {}
            OpResult::TimedOut => self.timeouts += 1,
            OpResult::Failed => self.errors += 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_read_that_is_not_a_hit_is_a_miss_with_its_cause() {
        let mut counters = L2Counters::default();
        for outcome in [
            ReadOutcome::Hit,
            ReadOutcome::Absent,
            ReadOutcome::Corrupt,
            ReadOutcome::TimedOut,
            ReadOutcome::Failed,
        ] {
            counters.record_read(outcome);
        }
        assert_eq!(
            counters,
            L2Counters {
                hits: 1,
                misses: 4,
                corrupt: 1,
                timeouts: 1,
                errors: 1,
                ..L2Counters::default()
            }
        );
    }

    #[test]
    fn writes_count_by_outcome_and_corrupt_reads_are_an_answer_for_the_breaker() {
        let mut counters = L2Counters::default();
        counters.record_write(WriteOutcome::Written);
        counters.record_write(WriteOutcome::TimedOut);
        counters.record_write(WriteOutcome::Failed);
        assert_eq!(
            (counters.writes, counters.timeouts, counters.errors),
            (1, 1, 1)
        );
        assert_eq!(ReadOutcome::Corrupt.op_result(), OpResult::Succeeded);
        assert_eq!(ReadOutcome::TimedOut.op_result(), OpResult::TimedOut);
        assert_eq!(WriteOutcome::Failed.op_result(), OpResult::Failed);
    }
}
