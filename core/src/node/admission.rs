//! Who may open one more connection: the node-wide bound (`--max-connections`) and each
//! holder's share of it, so that no one holder can take every connection and lock the
//! others out (failure mode 44). A holder is a uid (Unix peers), a TCP tenant (peers
//! that proved its token), or all TCP peers that have not authenticated yet together
//! ("strangers"): a uid and a TCP tenant hold at most `--max-connections-per-uid`,
//! strangers at most an eighth of the bound, so that tokenless peers cannot take the
//! places of the workers that hold a token (row 67).
//!
//! A share is counted against the places left: a uid or a TCP tenant holds at most the
//! same part (`--max-connections-per-uid` of `--max-connections`, three quarters by
//! default) of the places the other holders leave, so no one holder takes the last of
//! them: with 200 places, one uid holding 150 leaves 50, a second uid may take 37 of
//! those, a third 9 of the last 13.

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
        "uid {uid} already holds its share, {share} connections (--max-connections-per-uid \
         {per_uid}, and that part of the places the other uids leave, so that some always \
         stay for them)"
    )]
    UidShare {
        /// The uid.
        uid: u32,
        /// Its share now.
        share: usize,
        /// `--max-connections-per-uid`.
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
        "TCP tenant #{tenant} already holds its share, {share} connections \
         (--max-connections-per-uid {per_uid}, and that part of the places the others leave)"
    )]
    TenantShare {
        /// The tenant's index.
        tenant: u32,
        /// Its share now.
        share: usize,
        /// `--max-connections-per-uid`.
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
            Some(uid) if self.held(Holder::Uid(uid)) >= self.share(Holder::Uid(uid)) => {
                Err(Refused::UidShare {
                    uid,
                    share: self.share(Holder::Uid(uid)),
                    per_uid: self.limits.per_uid,
                })
            }
            _ => Ok(()),
        }
    }

    fn held(&self, holder: Holder) -> usize {
        self.by_holder.get(&holder).copied().unwrap_or(0)
    }

    /// What `holder` (a uid or a TCP tenant) may hold now: `--max-connections-per-uid`,
    /// and that part of the places the other holders leave (at least one).
    pub fn share(&self, holder: Holder) -> usize {
        self.share_with(holder, 0)
    }

    /// [`Admission::share`] when `coming` places counted already (a stranger's that is
    /// authenticating) are about to become `holder`'s.
    fn share_with(&self, holder: Holder, coming: usize) -> usize {
        let ConnectionLimits { max, per_uid, .. } = self.limits;
        let others = self.total.saturating_sub(self.held(holder) + coming);
        let left = max.saturating_sub(others);
        let of_left = (left as u128 * per_uid as u128 / max as u128) as usize;
        per_uid.min(of_left.max(1))
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
        // Its place is counted already, as a stranger's.
        let share = self.share_with(holder, 1);
        if self.held(holder) >= share {
            return Err(Refused::TenantShare {
                tenant,
                share,
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

    /// Connects `uid` until it is refused; returns how many it got.
    fn fill(admission: &mut Admission, uid: u32) -> usize {
        let mut got = 0;
        while admission.admits(Some(uid)).is_ok() {
            admission.connected(Holder::Uid(uid));
            got += 1;
        }
        got
    }

    #[test]
    fn one_uid_stops_at_its_share_and_others_still_connect_up_to_the_bound() {
        let mut admission = Admission::new(ConnectionLimits::new(20, None, None));
        // A uid takes its 15 and no more,
        assert_eq!(fill(&mut admission, 7), 15);
        assert_eq!(
            admission.admits(Some(7)),
            Err(Refused::UidShare {
                uid: 7,
                share: 15,
                per_uid: 15
            })
        );
        // while the others still connect, up to the bound: each share is counted
        // against the places left, so no one uid takes the last of them.
        assert_eq!(
            fill(&mut admission, 1000),
            3,
            "three quarters of the 5 left"
        );
        assert_eq!(fill(&mut admission, 1001), 1, "of the 2 left");
        assert_eq!(fill(&mut admission, 1002), 1, "the last one");
        assert_eq!(admission.admits(Some(1003)), Err(Refused::Full { max: 20 }));
        // A place uid 7 gives back is not its own to take again while the others hold
        // 5: its share is now three quarters of the 15 they leave; another uid's it is.
        admission.disconnected(Holder::Uid(7));
        assert_eq!(
            admission.admits(Some(7)),
            Err(Refused::UidShare {
                uid: 7,
                share: 11,
                per_uid: 15
            })
        );
        assert_eq!(admission.admits(Some(1003)), Ok(()));
    }

    /// Row 44 and issue 51: two uids cannot hold every place between them (150 + 50 of
    /// 200 before): the second gets three quarters of what the first leaves.
    #[test]
    fn a_share_is_counted_against_the_places_the_others_leave() {
        let mut admission = Admission::new(ConnectionLimits::new(200, None, None));
        assert_eq!(fill(&mut admission, 1), 150);
        assert_eq!(fill(&mut admission, 2), 37);
        assert_eq!(
            admission.share(Holder::Uid(3)),
            9,
            "three quarters of the last 13"
        );
        // An operator's explicit share is its part of the places left likewise.
        let mut admission = Admission::new(ConnectionLimits::new(100, Some(100), None));
        assert_eq!(
            fill(&mut admission, 1),
            100,
            "one uid may take all: the operator said so"
        );
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
        // A tenant at its share stays a stranger: its share is three quarters of the
        // places the others (the strangers, 5 of them) leave, 26 of 35.
        let mut conn = 10;
        while {
            arrive(&mut admission, conn);
            admission.authenticated(ConnId(conn), 0).is_ok()
        } {
            conn += 1;
        }
        assert_eq!(admission.held(Holder::Tenant(0)), 26);
        assert_eq!(
            admission.authenticated(ConnId(conn), 0),
            Err(Refused::TenantShare {
                tenant: 0,
                share: 26,
                per_uid: 30
            })
        );
    }
}
