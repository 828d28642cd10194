//! Connections: each one's peer (who it is, what it attached: [`super::trust`]), its
//! transport, the process behind it, the requests it has running (at most
//! [`MAX_IN_FLIGHT_PER_CONNECTION`], and at most [`MAX_ITEMS_IN_FLIGHT_PER_CONNECTION`]
//! items: a batch counts each of its items) and, over TCP, the deadline for its token.

use super::HashMap;
use crate::Module;
use crate::node::{
    ConnId, DeathNotice, Job, MAX_IN_FLIGHT_PER_CONNECTION, MAX_ITEMS_IN_FLIGHT_PER_CONNECTION,
    Node, Output, Peer, PeerAction, ProcessKey, TenantId, Transport, admission,
};
use crate::protocol::{ErrorCode, ProtocolError};
use crate::time::Instant;
use std::time::Duration;

pub(super) struct Conn {
    pub(super) uid: Option<u32>,
    /// Who the peer is, which tenant it acts for, what it attached.
    pub(super) peer: Peer,
    pub(super) transport: Transport,
    pub(super) process: Option<(ProcessKey, DeathNotice)>,
    in_flight: usize,
    /// Items of those requests (a batch's items; one for any other request).
    items_in_flight: usize,
    /// Whether fds may still arrive on it: over the Unix socket until a `hello` says
    /// `sends_fds: false` (then the shell reads it without `SCM_RIGHTS`); never over TCP.
    pub(super) sends_fds: bool,
    /// When a TCP peer must have presented its token ([`admission`]).
    pub(super) token_deadline: Option<Instant>,
    /// How long its client waits for a reply (`hello`'s `wait_ms`): the deadline of
    /// each request that writes into the worker's memory.
    pub(super) wait: Option<Duration>,
    /// Whose share of the connections it holds (a TCP peer moves from the strangers'
    /// to its tenant's when it authenticates).
    pub(super) holder: admission::Holder,
}

/// The connections, by id, and the requests they have running: the per-connection
/// caps are theirs.
#[derive(Default)]
pub(super) struct Conns {
    by_id: HashMap<ConnId, Conn>,
    /// Requests running on every connection together (a shutdown's drain waits for
    /// them).
    jobs_in_flight: usize,
}

impl Conns {
    pub(super) fn get(&self, conn: &ConnId) -> Option<&Conn> {
        self.by_id.get(conn)
    }

    pub(super) fn get_mut(&mut self, conn: &ConnId) -> Option<&mut Conn> {
        self.by_id.get_mut(conn)
    }

    pub(super) fn contains_key(&self, conn: &ConnId) -> bool {
        self.by_id.contains_key(conn)
    }

    pub(super) fn insert(&mut self, conn: ConnId, connection: Conn) {
        self.by_id.insert(conn, connection);
    }

    /// A connection went; what it had running is no longer counted against it.
    pub(super) fn remove(&mut self, conn: &ConnId) -> Option<Conn> {
        self.by_id.remove(conn)
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &Conn> {
        self.by_id.values()
    }

    pub(super) fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Requests running on every connection together.
    pub(super) fn jobs_in_flight(&self) -> usize {
        self.jobs_in_flight
    }

    /// Requests of `conn` still running (builds, copies, blends): a shell closes a
    /// connection only once they are answered.
    pub(super) fn in_flight(&self, conn: ConnId) -> usize {
        self.by_id
            .get(&conn)
            .map_or(0, |connection| connection.in_flight)
    }

    /// Whether `conn` may start one more request of `items` items (a batch's length;
    /// one for any other request): the in-flight limit counts items, so a connection's
    /// batches cannot queue 64 × 1,024 copies (row 68).
    pub(super) fn has_room(&self, conn: ConnId, items: usize) -> bool {
        self.by_id.get(&conn).is_some_and(|connection| {
            connection.in_flight < MAX_IN_FLIGHT_PER_CONNECTION
                && connection.items_in_flight + items <= MAX_ITEMS_IN_FLIGHT_PER_CONNECTION
        })
    }

    /// The refusal of a request [`Conns::has_room`] has no room for.
    pub(super) fn overloaded(&self, conn: ConnId) -> ProtocolError {
        let (requests, items) = self.by_id.get(&conn).map_or((0, 0), |connection| {
            (connection.in_flight, connection.items_in_flight)
        });
        ProtocolError::new(
            ErrorCode::Overloaded,
            format!(
                "this connection already has {requests} requests ({items} items) running; at \
                 most {MAX_IN_FLIGHT_PER_CONNECTION} requests and \
                 {MAX_ITEMS_IN_FLIGHT_PER_CONNECTION} items run at once (a batch counts its \
                 items); wait for replies before sending more"
            ),
        )
    }

    /// The tenant `conn` acts for (checked by `dispatch` before any op runs).
    pub(super) fn tenant(&self, conn: ConnId) -> TenantId {
        self.by_id
            .get(&conn)
            .and_then(|connection| connection.peer.tenant())
            .unwrap_or(TenantId(0))
    }

    /// A request of `conn` of `items` items starts running (answered later).
    pub(super) fn start_job(&mut self, conn: ConnId, items: usize) {
        self.jobs_in_flight += 1;
        if let Some(connection) = self.by_id.get_mut(&conn) {
            connection.in_flight += 1;
            connection.items_in_flight += items;
        }
    }

    /// The request [`Conns::start_job`] started is answered.
    pub(super) fn end_job(&mut self, conn: ConnId, items: usize) {
        self.jobs_in_flight = self.jobs_in_flight.saturating_sub(1);
        if let Some(connection) = self.by_id.get_mut(&conn) {
            connection.in_flight = connection.in_flight.saturating_sub(1);
            connection.items_in_flight = connection.items_in_flight.saturating_sub(items);
        }
    }
}

impl Node {
    /// A connection the shell accepted (after [`Node::admits`]).
    pub(super) fn connected(
        &mut self,
        now: Instant,
        conn: ConnId,
        uid: Option<u32>,
        transport: Transport,
        process: Option<(ProcessKey, DeathNotice)>,
    ) {
        // A shell that reuses a connection id ends the old connection first:
        // its proofs go with it, so no binding outlives every connection.
        if self.conns.contains_key(&conn) {
            self.disconnected(conn);
        }
        if let Some(uid) = uid
            && self.doors.trust.needs_room(uid)
        {
            self.forget_idle_tenants(); // row 70
        }
        let peer = self.doors.trust.connect(uid);
        let holder = admission::Holder::of(uid.map(|uid| self.doors.trust.counted_uid(uid)));
        self.doors.admission.connected(holder);
        let token_deadline = match transport {
            Transport::Tcp => self.doors.admission.awaiting_token(conn, now),
            Transport::Unix => None,
        };
        // Strangers (TCP peers that have not authenticated) hold their share together:
        // past it the oldest makes room for the newcomer, which may be a worker about to
        // prove its token (row 67).
        // Those already answering a challenge (a worker mid-handshake) go last.
        let conns = &self.conns;
        let challenged = |c: ConnId| conns.get(&c).is_some_and(|c| c.peer.has_challenge());
        if holder == admission::Holder::Stranger
            && let Some(oldest) = self.doors.admission.stranger_arrived(conn, challenged)
        {
            self.out
                .queue
                .push_back(Output::Peer(PeerAction::Disconnect {
                    conn: oldest,
                    why: "a TCP peer that has not authenticated (the oldest, one answering a \
                      challenge last) makes room for a new one (their share, an eighth of \
                      --max-connections, is full)",
                    reason: "stranger_share",
                }));
        }
        self.conns.insert(
            conn,
            Conn {
                uid,
                peer,
                transport,
                process,
                in_flight: 0,
                items_in_flight: 0,
                sends_fds: transport == Transport::Unix,
                token_deadline,
                wait: None,
                holder,
            },
        );
    }

    /// The shell found the process behind `conn` (after its `hello`).
    pub(super) fn peer_process(&mut self, conn: ConnId, process: ProcessKey, notice: DeathNotice) {
        if let Some(connection) = self.conns.get_mut(&conn) {
            connection.process = Some((process, notice));
        }
    }

    /// A connection went: its proofs go with it, and an instance nobody attached any
    /// more and that holds no entry is unbound.
    pub(super) fn disconnected(&mut self, conn: ConnId) {
        let Some(connection) = self.conns.remove(&conn) else {
            return;
        };
        self.doors.admission.disconnected(connection.holder);
        if connection.holder == admission::Holder::Stranger {
            self.doors.admission.stranger_left(conn);
        }
        if let Some(deadline) = connection.token_deadline {
            self.doors.admission.forget_deadline(conn, deadline);
        }
        let tenant = connection.peer.tenant();
        for instance in self.doors.trust.disconnect(connection.peer) {
            let holds_entry = Module::ALL
                .iter()
                .any(|&module| self.registry.records.contains_key(&(instance, module)));
            if !holds_entry {
                self.doors.trust.release(instance);
            }
        }
        if let Some(tenant) = tenant
            && self.holds_nothing(tenant, None)
        {
            self.doors.trust.forget(tenant); // row 70: its last connection went
        }
    }

    /// Forgets every tenant made on the fly for a uid that holds nothing (row 70): a
    /// uid that comes back gets one anew, so the tenants tracked are those that hold
    /// something, not every uid that ever connected.
    fn forget_idle_tenants(&mut self) {
        let mut busy = std::collections::HashSet::new();
        busy.extend(self.conns.values().filter_map(|c| c.peer.tenant()));
        busy.extend(self.registry.records.values().map(|entry| entry.tenant));
        let idle: Vec<TenantId> = self
            .doors
            .trust
            .made_on_the_fly()
            .filter(|&tenant| self.holds_nothing(tenant, Some(&busy)))
            .collect();
        for tenant in idle {
            self.doors.trust.forget(tenant);
        }
    }

    /// Whether `tenant` holds nothing: no connection, entry, L1 slot (stored, being
    /// written or pinned), mapped byte or copy waiting its turn. `busy`: the tenants
    /// of every connection and entry, when a sweep gathered them once.
    fn holds_nothing(
        &self,
        tenant: TenantId,
        busy: Option<&std::collections::HashSet<TenantId>>,
    ) -> bool {
        let cheap = self.doors.trust.made_for_a_uid(tenant)
            && self.l1.slots.tenant_slots(tenant) == 0
            && self.doors.mapped.of_tenant(tenant) == 0
            && !self.work.jobs.has_waiting(tenant);
        cheap
            && match busy {
                Some(busy) => !busy.contains(&tenant),
                None => {
                    !self.conns.values().any(|c| c.peer.tenant() == Some(tenant))
                        && !self
                            .registry
                            .records
                            .values()
                            .any(|entry| entry.tenant == tenant)
                }
            }
    }

    /// Asks the shell to close every TCP connection still unauthenticated at its
    /// deadline (failure mode 44).
    pub(super) fn cut_unauthenticated(&mut self, now: Instant) {
        for (deadline, conn) in self.doors.admission.take_expired(now) {
            let Some(connection) = self.conns.get_mut(&conn) else {
                continue;
            };
            if connection.token_deadline != Some(deadline) {
                continue; // a deadline of an earlier connection of this id
            }
            connection.token_deadline = None;
            if connection.peer.tenant().is_none() {
                self.out
                    .queue
                    .push_back(Output::Peer(PeerAction::Disconnect {
                        conn,
                        why: "a TCP peer did not prove it holds the server's token within \
                          --frame-timeout-seconds of connecting",
                        reason: "unauthenticated",
                    }));
            }
        }
    }

    /// Requests of `conn` still running (builds, copies, blends): a shell closes a
    /// connection only once they are answered.
    pub fn in_flight(&self, conn: ConnId) -> usize {
        self.conns.in_flight(conn)
    }

    /// Where the pidfd a `hello` of `conn` names (`pidfd_index` = `index`, in a frame
    /// that carried `carried` fds) sits among them: the rules of a peer's proof of exit
    /// that need no kernel. A pidfd travels only over the Unix socket, once per
    /// connection, with the frame that names it. The shell then checks the fd (a pidfd,
    /// of the peer's own process) and reports it as `Input::PeerProcess`. None: nothing
    /// to adopt (the server is shutting down and refuses the `hello` anyway, or the
    /// connection is unknown).
    pub fn hello_pidfd(
        &self,
        conn: ConnId,
        index: u64,
        carried: usize,
    ) -> Result<Option<usize>, ProtocolError> {
        let bad_args = |message: String| ProtocolError::new(ErrorCode::BadArgs, message);
        let Some(connection) = self.conns.get(&conn).filter(|_| !self.shutdown.begun()) else {
            return Ok(None);
        };
        if connection.transport != Transport::Unix {
            return Err(bad_args(format!(
                "`hello`: pidfd_index {index}, but a pidfd travels only over the Unix socket \
                 (SCM_RIGHTS) and this connection is TCP; leave pidfd_index out over TCP"
            )));
        }
        if matches!(connection.process, Some((_, DeathNotice::PidfdFromPeer))) {
            return Err(bad_args(format!(
                "`hello`: pidfd_index {index}, but this connection already sent its pidfd; \
                 send it once per connection"
            )));
        }
        let Some(position) = usize::try_from(index).ok().filter(|&i| i < carried) else {
            let fix = if connection.sends_fds {
                "send the pidfd as SCM_RIGHTS with the frame's first byte"
            } else {
                "this connection said `sends_fds: false` in an earlier `hello`, so the \
                 kernel dropped it; send the pidfd in the first `hello`"
            };
            return Err(bad_args(format!(
                "`hello`: pidfd_index {index} names an fd this frame did not carry (it \
                 carried {carried}); {fix}"
            )));
        };
        Ok(Some(position))
    }

    /// Hands a copy of `conn`'s tenant to the pool's queue ([`jobs`]): it goes to the
    /// shell in its tenant's turn.
    pub(super) fn submit_copy(&mut self, conn: ConnId, job: Job) {
        if !self.shutdown.runs_copies() {
            self.cancel_copy(job);
            return;
        }
        let tenant = self.conns.tenant(conn);
        self.submit_for(tenant, job);
    }

    /// A copy that will not run (the shutdown's drain is over): it ends failed, so its
    /// request is answered and its context's free no longer waits for it.
    pub(super) fn cancel_copy(&mut self, job: Job) {
        if let Job::Copy { copy, .. } = job {
            self.copy_done(
                copy,
                Err(ProtocolError::new(
                    ErrorCode::Unavailable,
                    "the server shut down before this copy ran; reconnect to its successor, \
                     register again and retry",
                )),
            );
        }
    }

    /// Hands `tenant`'s job to the pool's queue: it goes in its tenant's turn.
    pub(super) fn submit_for(&mut self, tenant: TenantId, job: Job) {
        self.work.jobs.push(tenant, job);
        self.hand_out_jobs();
    }

    /// Hands a build or a blend to the shell at once (it counts in the pool's window).
    pub(super) fn submit_now(&mut self, job: Job) {
        let job = self.work.jobs.now(job);
        self.out.queue.push_back(Output::Job(job));
    }

    /// A build, copy or blend handed out reported back: the next in turn goes.
    pub(super) fn job_reported(&mut self) {
        self.work.jobs.finished();
        self.hand_out_jobs();
    }

    fn hand_out_jobs(&mut self) {
        while let Some(job) = self.work.jobs.next() {
            self.out.queue.push_back(Output::Job(job));
        }
    }
}
