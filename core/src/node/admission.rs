//! Who may open one more connection: the node-wide bound (`--max-connections`) and each
//! holder's share of it, so that no one holder can take every connection and lock the
//! others out (failure mode 44). A holder is a uid (Unix peers), a TCP tenant (peers
//! that proved its token), or all TCP peers that have not authenticated yet together
//! ("strangers"): a uid and a TCP tenant hold at most `--max-connections-per-uid`,
//! strangers at most an eighth of the bound, so that tokenless peers cannot take the
//! places of the workers that hold a token (row 67).

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
    /// Connections one uid, or one TCP tenant, holds at once.
    pub per_uid: usize,
    /// Connections TCP peers that have not authenticated hold at once, all together.
    pub per_stranger: usize,
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
            per_stranger: (max / 8).max(1),
            unauthenticated_timeout,
        }
    }

    /// No bound that a test or a simulation would reach.
    pub fn unbounded() -> ConnectionLimits {
        ConnectionLimits {
            max: usize::MAX,
            per_uid: usize::MAX,
            per_stranger: usize::MAX,
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
        "uid {uid} already holds --max-connections-per-uid {per_uid} connections (a quarter \
         of --max-connections is kept for the other uids)"
    )]
    UidShare {
        /// The uid.
        uid: u32,
        /// The share.
        per_uid: usize,
    },
    /// TCP peers that have not authenticated hold their whole share.
    #[error(
        "TCP peers that have not authenticated hold their share already ({per_stranger}, \
         an eighth of --max-connections); the places of authenticated workers and of \
         every uid stay theirs"
    )]
    StrangerShare {
        /// The share.
        per_stranger: usize,
    },
    /// A TCP tenant holds its whole share (refused at its `hello`).
    #[error(
        "TCP tenant #{tenant} already holds --max-connections-per-uid {per_uid} \
         connections"
    )]
    TenantShare {
        /// The tenant's index.
        tenant: u32,
        /// The share.
        per_uid: usize,
    },
}

/// Who holds a connection's place.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Holder {
    /// A Unix peer's uid.
    Uid(u32),
    /// TCP peers that have not authenticated, all together.
    Stranger,
    /// TCP peers that proved this tenant's token.
    Tenant(u32),
}

impl Holder {
    /// A new connection's holder: its uid, or (TCP) a stranger until it authenticates.
    pub fn of(uid: Option<u32>) -> Holder {
        uid.map_or(Holder::Stranger, Holder::Uid)
    }
}

impl Refused {
    /// Its name in metrics and logs: `max_connections`, `uid_share` (a TCP tenant's
    /// too) or `stranger_share`.
    pub fn label(self) -> &'static str {
        match self {
            Refused::Full { .. } => "max_connections",
            Refused::UidShare { .. } | Refused::TenantShare { .. } => "uid_share",
            Refused::StrangerShare { .. } => "stranger_share",
        }
    }
}

/// The connections held, all together and per uid, and when each TCP peer that has not
/// authenticated yet must have.
#[derive(Debug)]
pub struct Admission {
    limits: ConnectionLimits,
    total: usize,
    by_holder: HashMap<Holder, usize>,
    /// (deadline, connection) of TCP peers connected with a deadline to authenticate.
    token_deadlines: BTreeSet<(Instant, ConnId)>,
    /// Strangers still connected, oldest first, and those asked to close past their
    /// share (they still count until they are gone).
    strangers: std::collections::VecDeque<ConnId>,
    evicted: BTreeSet<ConnId>,
}

impl Admission {
    /// Nothing held yet.
    pub fn new(limits: ConnectionLimits) -> Admission {
        Admission {
            limits,
            total: 0,
            by_holder: HashMap::new(),
            token_deadlines: BTreeSet::new(),
            strangers: std::collections::VecDeque::new(),
            evicted: BTreeSet::new(),
        }
    }

    /// Whether a peer of `uid` (None: TCP) may open one more connection now.
    pub fn admits(&self, uid: Option<u32>) -> Result<(), Refused> {
        if self.total >= self.limits.max {
            return Err(Refused::Full {
                max: self.limits.max,
            });
        }
        match uid {
            // Past their share the oldest stranger makes room ([`Self::stranger_arrived`]);
            // only strangers already asked to close and not yet gone refuse a newcomer.
            None if self.evicted.len() >= self.limits.per_stranger => Err(Refused::StrangerShare {
                per_stranger: self.limits.per_stranger,
            }),
            Some(uid) if self.held(Holder::Uid(uid)) >= self.limits.per_uid => {
                Err(Refused::UidShare {
                    uid,
                    per_uid: self.limits.per_uid,
                })
            }
            _ => Ok(()),
        }
    }

    fn held(&self, holder: Holder) -> usize {
        self.by_holder.get(&holder).copied().unwrap_or(0)
    }

    /// A connection of `holder` was opened.
    pub fn connected(&mut self, holder: Holder) {
        self.total += 1;
        *self.by_holder.entry(holder).or_insert(0) += 1;
    }

    /// A connection of `holder` closed.
    pub fn disconnected(&mut self, holder: Holder) {
        self.total = self.total.saturating_sub(1);
        self.release(holder);
    }

    fn release(&mut self, holder: Holder) {
        if let Some(count) = self.by_holder.get_mut(&holder) {
            *count -= 1;
            if *count == 0 {
                self.by_holder.remove(&holder);
            }
        }
    }

    /// A stranger `conn` connected: when strangers hold more than their share, the one
    /// to ask the shell to close: the oldest (never `conn`) for which `spare` is true,
    /// else the oldest.
    pub fn stranger_arrived(
        &mut self,
        conn: ConnId,
        spare: impl Fn(ConnId) -> bool,
    ) -> Option<ConnId> {
        self.strangers.push_back(conn);
        if self.strangers.len() - self.evicted.len() <= self.limits.per_stranger {
            return None;
        }
        let candidates = || {
            self.strangers
                .iter()
                .copied()
                .filter(|stranger| !self.evicted.contains(stranger) && *stranger != conn)
        };
        let victim = candidates()
            .find(|&stranger| !spare(stranger))
            .or_else(|| candidates().next())?;
        self.evicted.insert(victim);
        Some(victim)
    }

    /// A stranger closed, or authenticated.
    pub fn stranger_left(&mut self, conn: ConnId) {
        if let Some(position) = self.strangers.iter().position(|&s| s == conn) {
            self.strangers.remove(position);
        }
        self.evicted.remove(&conn);
    }

    /// A stranger proved `tenant`'s token: its place moves to that tenant's share, or,
    /// when the tenant holds its whole share already, it stays a stranger (refused).
    pub fn authenticated(&mut self, conn: ConnId, tenant: u32) -> Result<Holder, Refused> {
        let holder = Holder::Tenant(tenant);
        if self.held(holder) >= self.limits.per_uid {
            return Err(Refused::TenantShare {
                tenant,
                per_uid: self.limits.per_uid,
            });
        }
        self.stranger_left(conn);
        self.release(Holder::Stranger);
        *self.by_holder.entry(holder).or_insert(0) += 1;
        Ok(holder)
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
        // A uid takes its 15 ...
        for _ in 0..15 {
            assert_eq!(admission.admits(Some(7)), Ok(()));
            admission.connected(Holder::Uid(7));
        }
        // ... and no more,
        assert_eq!(
            admission.admits(Some(7)),
            Err(Refused::UidShare {
                uid: 7,
                per_uid: 15
            })
        );
        // while a Unix worker of another uid still connects, up to the bound.
        for _ in 0..5 {
            assert_eq!(admission.admits(Some(1000)), Ok(()));
            admission.connected(Holder::Uid(1000));
        }
        assert_eq!(admission.admits(Some(1001)), Err(Refused::Full { max: 20 }));
        // A closed connection gives its place back to its uid.
        admission.disconnected(Holder::Uid(7));
        assert_eq!(admission.admits(Some(7)), Ok(()));
        assert_eq!(admission.admits(Some(1001)), Ok(()));
    }

    /// Row 67: tokenless TCP peers hold an eighth of the bound together: past it the
    /// oldest makes room for a newcomer (which may be a worker about to authenticate);
    /// a peer that authenticates moves to its tenant's share.
    #[test]
    fn strangers_keep_to_their_share_and_authenticated_peers_leave_it() {
        let mut admission = Admission::new(ConnectionLimits::new(40, None, None));
        let arrive = |admission: &mut Admission, conn: u64| {
            assert_eq!(admission.admits(None), Ok(()));
            admission.connected(Holder::Stranger);
            admission.stranger_arrived(ConnId(conn), |_| false)
        };
        for conn in 0..5 {
            assert_eq!(arrive(&mut admission, conn), None);
        }
        // The sixth: the oldest goes, never the newcomer; then the next oldest.
        assert_eq!(arrive(&mut admission, 5), Some(ConnId(0)));
        assert_eq!(arrive(&mut admission, 6), Some(ConnId(1)));
        admission.disconnected(Holder::Stranger);
        admission.stranger_left(ConnId(0));
        // A Unix uid still connects (the control).
        assert_eq!(admission.admits(Some(1000)), Ok(()));
        // One proves a token: it leaves the strangers' share.
        assert_eq!(admission.authenticated(ConnId(6), 0), Ok(Holder::Tenant(0)));
        assert_eq!(admission.held(Holder::Tenant(0)), 1);
        // A tenant at its share stays a stranger.
        for conn in 10..39 {
            arrive(&mut admission, conn);
            assert_eq!(
                admission.authenticated(ConnId(conn), 0),
                Ok(Holder::Tenant(0))
            );
        }
        arrive(&mut admission, 39);
        assert_eq!(
            admission.authenticated(ConnId(39), 0),
            Err(Refused::TenantShare {
                tenant: 0,
                per_uid: 30
            })
        );
    }
}
