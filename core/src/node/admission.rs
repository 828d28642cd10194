//! Who may open one more connection: the node-wide bound (`--max-connections`) and each
//! uid's share of it (`--max-connections-per-uid`), so that one uid — or all TCP peers
//! together, who have no uid — cannot take every connection and lock the others out
//! (failure mode 44).

use super::ConnId;
use crate::Instant;
use std::collections::{BTreeSet, HashMap};
use std::time::Duration;
use thiserror::Error;

/// The bounds on connections held at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections held at once, all peers together.
    pub max: usize,
    /// Connections one uid holds at once (TCP peers count as one uid).
    pub per_uid: usize,
    /// How long a TCP peer may stay connected without presenting a token (None: for
    /// ever). Past it the node asks the shell to close the connection: an unauthenticated
    /// peer that sent one frame and went quiet would otherwise hold one of the TCP
    /// share's places for good.
    pub unauthenticated_timeout: Option<Duration>,
}

impl ConnectionLimits {
    /// `max` connections, `per_uid` of them per uid (None: three quarters of `max`, so
    /// that a quarter always stays for the other uids). `per_uid` is lowered to `max`.
    pub fn new(
        max: usize,
        per_uid: Option<usize>,
        unauthenticated_timeout: Option<Duration>,
    ) -> ConnectionLimits {
        let max = max.max(1);
        let per_uid = per_uid.unwrap_or(max - max / 4).clamp(1, max);
        ConnectionLimits {
            max,
            per_uid,
            unauthenticated_timeout,
        }
    }

    /// No bound that a test or a simulation would reach.
    pub fn unbounded() -> ConnectionLimits {
        ConnectionLimits {
            max: usize::MAX,
            per_uid: usize::MAX,
            unauthenticated_timeout: None,
        }
    }
}

/// Why a connection was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
pub enum Refused {
    /// Every connection is taken.
    #[error("--max-connections reached (all {max} connections are held)")]
    Full {
        /// The bound.
        max: usize,
    },
    /// The peer's uid holds its whole share.
    #[error(
        "{} already holds --max-connections-per-uid {per_uid} connections (a quarter of \
         --max-connections is kept for the other uids)",
        uid.map_or_else(|| "TCP (all TCP peers together)".to_string(), |uid| format!("uid {uid}"))
    )]
    UidShare {
        /// The uid; None for TCP.
        uid: Option<u32>,
        /// The share.
        per_uid: usize,
    },
}

impl Refused {
    /// Its name in metrics and logs: `max_connections` or `uid_share`.
    pub fn label(self) -> &'static str {
        match self {
            Refused::Full { .. } => "max_connections",
            Refused::UidShare { .. } => "uid_share",
        }
    }
}

/// The connections held, all together and per uid, and when each TCP peer that has not
/// authenticated yet must have.
#[derive(Debug)]
pub struct Admission {
    limits: ConnectionLimits,
    total: usize,
    by_uid: HashMap<Option<u32>, usize>,
    /// (deadline, connection) of TCP peers connected with a deadline to authenticate.
    token_deadlines: BTreeSet<(Instant, ConnId)>,
}

impl Admission {
    /// Nothing held yet.
    pub fn new(limits: ConnectionLimits) -> Admission {
        Admission {
            limits,
            total: 0,
            by_uid: HashMap::new(),
            token_deadlines: BTreeSet::new(),
        }
    }

    /// Whether a peer of `uid` (None: TCP) may open one more connection now.
    pub fn admits(&self, uid: Option<u32>) -> Result<(), Refused> {
        if self.total >= self.limits.max {
            return Err(Refused::Full {
                max: self.limits.max,
            });
        }
        if self.by_uid.get(&uid).copied().unwrap_or(0) >= self.limits.per_uid {
            return Err(Refused::UidShare {
                uid,
                per_uid: self.limits.per_uid,
            });
        }
        Ok(())
    }

    /// A connection of `uid` was opened.
    pub fn connected(&mut self, uid: Option<u32>) {
        self.total += 1;
        *self.by_uid.entry(uid).or_insert(0) += 1;
    }

    /// A connection of `uid` closed.
    pub fn disconnected(&mut self, uid: Option<u32>) {
        self.total = self.total.saturating_sub(1);
        if let Some(count) = self.by_uid.get_mut(&uid) {
            *count -= 1;
            if *count == 0 {
                self.by_uid.remove(&uid);
            }
        }
    }

    /// A TCP peer connected at `now`: the deadline by which it must present a token,
    /// if there is one.
    pub fn awaiting_token(&mut self, conn: ConnId, now: Instant) -> Option<Instant> {
        let deadline = now + self.limits.unauthenticated_timeout?;
        self.token_deadlines.insert((deadline, conn));
        Some(deadline)
    }

    /// The earliest deadline to authenticate.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.token_deadlines.first().map(|&(at, _)| at)
    }

    /// The deadlines passed by `now`, earliest first (each taken once).
    pub fn take_expired(&mut self, now: Instant) -> Vec<(Instant, ConnId)> {
        let mut expired = Vec::new();
        while let Some(&(at, conn)) = self.token_deadlines.first()
            && at <= now
        {
            self.token_deadlines.pop_first();
            expired.push((at, conn));
        }
        expired
    }

    /// Forgets `conn`'s deadline (it authenticated, or left).
    pub fn forget_deadline(&mut self, conn: ConnId, deadline: Instant) {
        self.token_deadlines.remove(&(deadline, conn));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_share_keeps_a_quarter_for_the_other_uids() {
        assert_eq!(ConnectionLimits::new(20, None, None).per_uid, 15);
        assert_eq!(ConnectionLimits::new(1, None, None).per_uid, 1);
        assert_eq!(
            ConnectionLimits::new(10, Some(50), None).per_uid,
            10,
            "lowered to max"
        );
        assert_eq!(
            ConnectionLimits::new(10, Some(0), None).per_uid,
            1,
            "never zero"
        );
    }

    #[test]
    fn one_uid_stops_at_its_share_and_others_still_connect_up_to_the_bound() {
        let mut admission = Admission::new(ConnectionLimits::new(20, None, None));
        // TCP peers (no uid) take their 15 ...
        for _ in 0..15 {
            assert_eq!(admission.admits(None), Ok(()));
            admission.connected(None);
        }
        // ... and no more,
        assert_eq!(
            admission.admits(None),
            Err(Refused::UidShare {
                uid: None,
                per_uid: 15
            })
        );
        // while a Unix worker of another uid still connects, up to the bound.
        for _ in 0..5 {
            assert_eq!(admission.admits(Some(1000)), Ok(()));
            admission.connected(Some(1000));
        }
        assert_eq!(admission.admits(Some(1001)), Err(Refused::Full { max: 20 }));
        // A closed connection gives its place back to its uid.
        admission.disconnected(None);
        assert_eq!(admission.admits(None), Ok(()));
        assert_eq!(admission.admits(Some(1001)), Ok(()));
    }
}
