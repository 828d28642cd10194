//! The simulated L2 store (rows 27–29): what the production shell does with a Redis
//! Cluster, in simulation. A key → value map where each value records whether it holds
//! the published bytes of its key (the workers' contents are deterministic per key, so a
//! value is identified by its key and whether it is whole), a delay per operation, and
//! faults: down (every operation fails), partitioned (no answer: the shell's client
//! times out), slow (answers later than the node's timeout, with the real result),
//! corrupt values (a fraction of reads find a torn value: answered `Corrupt`, and the
//! key deleted as the shell deletes it), flaky (a fraction of operations fail).
//!
//! The store outlives a server restart (Redis is another process). What each
//! operation finds is decided when it completes, against the store then; whether it
//! fails, times out or finds a torn value is drawn when it is issued, from the run's
//! only generator.

use crate::time::{MILLISECOND, Nanos};
use kvwarden_core::l2::{L2HealthConfig, WriteOutcome};
use kvwarden_core::node::l2::{L2Fetched, L2NodeConfig, L2Presence, L2ReadId, L2WriteId};
use std::collections::BTreeMap;

/// The `[l2]` section of a scenario (or the swarm's draw).
#[derive(Clone, Debug, PartialEq)]
pub struct L2Spec {
    /// Whether the node runs with L2 at all.
    pub enabled: bool,
    /// How long an operation takes when nothing is wrong.
    pub delay: Nanos,
    /// The node's bound on every L2 wait (`--l2-timeout-ms`), also the shell's client
    /// timeout (a partitioned L2 is answered `TimedOut` after it).
    pub timeout: Nanos,
    /// The write-behind queue's bound in bytes.
    pub queue_bytes: u64,
    /// The fraction of reads of a present key that find it torn, from the start.
    pub corrupt_rate: f64,
}

impl Default for L2Spec {
    fn default() -> L2Spec {
        L2Spec {
            enabled: false,
            delay: MILLISECOND,
            timeout: 50 * MILLISECOND,
            queue_bytes: 64 << 20,
            corrupt_rate: 0.0,
        }
    }
}

impl L2Spec {
    /// The node's view of it, None when disabled.
    pub fn node_config(&self) -> Option<L2NodeConfig> {
        self.enabled.then(|| L2NodeConfig {
            timeout: crate::time::duration(self.timeout),
            write_queue_bytes: self.queue_bytes,
            health: L2HealthConfig::default(),
        })
    }
}

/// One operation the node asked of L2.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum L2Job {
    /// `L2Request::Write`.
    Write {
        /// The node's id.
        write: L2WriteId,
        /// The key.
        key: Vec<u8>,
        /// Payload bytes.
        nbytes: u64,
        /// Whether the bytes written are published data (the checker said so).
        good: bool,
    },
    /// `L2Request::Get`.
    Get {
        /// The node's id.
        read: L2ReadId,
        /// The key.
        key: Vec<u8>,
    },
    /// The answer an `L2Request::Cancel` gets at once when Redis has not answered yet:
    /// `TimedOut`, with no delay.
    Cancelled {
        /// The node's id.
        read: L2ReadId,
        /// Whether it is an existence check (`L2Request::Exists`), not a read.
        check: bool,
    },
    /// `L2Request::Exists`.
    Exists {
        /// The node's id.
        read: L2ReadId,
        /// The keys, in order.
        keys: Vec<Vec<u8>>,
    },
}

/// How an issued operation will end, drawn when it was issued.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum L2Fate {
    /// Carried out against the store when it completes; `torn`: a read finds the
    /// value torn.
    Done {
        /// A read finds its value torn.
        torn: bool,
    },
    /// Refused (L2 down).
    Failed,
    /// No answer (partitioned): the client's timeout.
    TimedOut,
}

/// One stored value.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// Payload bytes.
    pub nbytes: u64,
    /// Whether these are the published bytes of the key (false: garbage).
    pub good: bool,
}

/// The store and its faults.
#[derive(Clone, Debug, Default)]
pub struct SimL2 {
    /// The settings.
    pub spec: L2Spec,
    values: BTreeMap<Vec<u8>, Stored>,
    /// Every operation fails.
    pub down: bool,
    /// No operation is answered (the client times out).
    pub partitioned: bool,
    /// Operations take this long instead of `spec.delay`.
    pub slow: Option<Nanos>,
    /// The fraction of reads that find a torn value.
    pub corrupt_rate: f64,
    /// The fraction of operations that fail (a flaky connection).
    pub flaky_rate: f64,
    /// Counters for expectations: reads answered `Corrupt`.
    pub corrupt_answers: u64,
    /// Reads answered with a hit.
    pub hits: u64,
    /// Writes carried out.
    pub writes: u64,
}

impl SimL2 {
    /// A store with these settings, empty, healthy.
    pub fn new(spec: L2Spec) -> SimL2 {
        SimL2 {
            corrupt_rate: spec.corrupt_rate,
            spec,
            ..SimL2::default()
        }
    }

    /// Ends every fault (the swarm's final heal); the values stay.
    pub fn heal(&mut self) {
        self.down = false;
        self.partitioned = false;
        self.slow = None;
        self.corrupt_rate = 0.0;
        self.flaky_rate = 0.0;
    }

    /// When an operation issued now ends, and how (`torn_roll` and `flaky_roll` are
    /// the generator's draws, in [0, 1)).
    pub fn issue(&self, torn_roll: f64, flaky_roll: f64) -> (Nanos, L2Fate) {
        if self.down || flaky_roll < self.flaky_rate {
            (self.spec.delay, L2Fate::Failed)
        } else if self.partitioned {
            (self.spec.timeout, L2Fate::TimedOut)
        } else {
            let delay = self.slow.unwrap_or(self.spec.delay);
            let torn = torn_roll < self.corrupt_rate;
            (delay, L2Fate::Done { torn })
        }
    }

    /// Overwrites every value whose key starts with `prefix` with garbage (something
    /// else wrote them, or another format version).
    pub fn garble(&mut self, prefix: &[u8]) {
        for (_, value) in self
            .values
            .range_mut(prefix.to_vec()..)
            .take_while(|(key, _)| key.starts_with(prefix))
        {
            value.good = false;
        }
    }

    /// The value of `key`, if any.
    pub fn value(&self, key: &[u8]) -> Option<Stored> {
        self.values.get(key).copied()
    }

    /// Carries out a write.
    pub fn write(&mut self, fate: L2Fate, key: Vec<u8>, nbytes: u64, good: bool) -> WriteOutcome {
        match fate {
            L2Fate::Done { .. } => {
                self.writes += 1;
                self.values.insert(key, Stored { nbytes, good });
                WriteOutcome::Written
            }
            L2Fate::Failed => WriteOutcome::Failed,
            L2Fate::TimedOut => WriteOutcome::TimedOut,
        }
    }

    /// Carries out a read: a torn or garbage value is `Corrupt` and deleted.
    pub fn get(&mut self, fate: L2Fate, key: &[u8]) -> L2Fetched {
        match fate {
            L2Fate::Done { torn } => match self.values.get(key).copied() {
                None => L2Fetched::Absent,
                Some(value) if torn || !value.good => {
                    self.values.remove(key);
                    self.corrupt_answers += 1;
                    L2Fetched::Corrupt
                }
                Some(value) => {
                    self.hits += 1;
                    L2Fetched::Hit {
                        nbytes: value.nbytes,
                    }
                }
            },
            L2Fate::Failed => L2Fetched::Failed,
            L2Fate::TimedOut => L2Fetched::TimedOut,
        }
    }

    /// Carries out an existence check: how many leading keys exist.
    pub fn exists(&self, fate: L2Fate, keys: &[Vec<u8>]) -> L2Presence {
        match fate {
            L2Fate::Done { .. } => L2Presence::Present(
                keys.iter()
                    .take_while(|key| self.values.contains_key(key.as_slice()))
                    .count() as u64,
            ),
            L2Fate::Failed => L2Presence::Failed,
            L2Fate::TimedOut => L2Presence::TimedOut,
        }
    }
}
