//! Connections: accepting, bounded reads, frames, replies and flushing.

use super::{FRAMES_PER_TURN, HashMap, SWEEP_EVERY, Server};
use crate::protocol::ErrorCode;
use crate::protocol::FrameError;
use crate::protocol::ProtocolError;
use crate::protocol::decode_request;
use crate::server::closer;
use crate::server::connection::Connection;
use crate::server::connection::JUDGED_AFTER_FDS;
use crate::server::connection::MAX_HELD_FDS;
use crate::server::connection::PeerSocket;
use crate::server::connection::SocketRead;
use crate::server::peer;
use kvwarden_core::node::ConnId;
use kvwarden_core::node::Input;
use kvwarden_core::node::Transport;
use mio::Interest;
use mio::Token;
use rmpv::Value;
use std::io;

impl Server {
    // ---------------------------------------------------------------- connections

    pub(super) fn admit(
        &mut self,
        mut stream: PeerSocket,
        mut peer: crate::server::connection::Credentials,
    ) {
        if let Err(refused) = self.node.admits(peer.uid) {
            let transport = match stream {
                PeerSocket::Unix(_) => "unix",
                PeerSocket::Tcp(_) => "tcp",
            };
            tracing::warn!(
                uid = peer.uid,
                transport,
                "refusing a connection: {refused}"
            );
            self.cut(transport, refused.label());
            closer::close_stream(stream);
            return;
        }
        let token = self.token();
        // Writable readiness is asked for only while replies wait on a full socket
        // buffer (see `flush_dirty`): otherwise every reply the peer reads would wake
        // the loop for nothing.
        let interest = Interest::READABLE;
        if let Err(error) = self
            .poll
            .registry()
            .register(stream.source(), token, interest)
        {
            tracing::warn!(%error, "registering a connection failed");
            closer::close_stream(stream);
            return;
        }
        let transport = match stream {
            PeerSocket::Unix(_) => Transport::Unix,
            PeerSocket::Tcp(_) => Transport::Tcp,
        };
        let process = match (peer.process, &peer.pidfd) {
            (Some(process), Some(_)) => {
                let key = self.processes.hold(process);
                peer.key = Some(key);
                Some((key, peer.death_notice()))
            }
            _ => None,
        };
        let uid = peer.uid;
        let max_output = (4 * self.config.max_frame_bytes).max(4 << 20);
        let connection = Connection::new(stream, peer, self.config.max_frame_bytes, max_output);
        self.connections.insert(token, connection);
        self.metrics.connections.set(self.connections.len() as i64);
        self.input(Input::Connected {
            conn: conn_id(token),
            uid,
            transport,
            process,
        });
        // A TCP peer's first request (`auth`) is often here already: read it before the
        // next accept, so that a worker starting its handshake is one the node spares
        // when strangers flood in behind it (row 67).
        if transport == Transport::Tcp {
            self.read_connection(token, false);
        }
    }

    pub(super) fn accept_unix(&mut self) {
        loop {
            let Some(listener) = &self.unix_listener else {
                return;
            };
            match listener.accept() {
                Ok((stream, _)) => {
                    let peer = peer::peer_of(&stream);
                    self.admit(PeerSocket::Unix(stream), peer);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!(error = %e, "accept on the Unix socket failed");
                    return;
                }
            }
        }
    }

    /// One TCP connection a turn: the next is accepted after this turn's events are
    /// read, so that a worker's `auth` that has arrived is read (and the worker spared
    /// as one mid-handshake) before strangers queued behind it are let in (row 67).
    pub(super) fn accept_tcp(&mut self) {
        if self.tcp_accepted_this_turn {
            self.tcp_accept_again = true;
            return;
        }
        self.tcp_accept_again = false;
        let Some(listener) = &self.tcp_listener else {
            return;
        };
        match listener.accept() {
            Ok((stream, _)) => {
                let _ = stream.set_nodelay(true);
                self.admit(
                    PeerSocket::Tcp(stream),
                    crate::server::connection::Credentials::default(),
                );
                // There may be more: the next turn accepts the next one.
                self.tcp_accepted_this_turn = true;
                self.tcp_accept_again = true;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => tracing::warn!(error = %e, "accept on the TCP socket failed"),
        }
    }

    pub(super) fn close(&mut self, token: Token, why: &str) {
        if let Some(mut connection) = self.connections.remove(&token) {
            self.buffered_bytes -= connection.counted_memory;
            let _ = self.poll.registry().deregister(connection.stream.source());
            tracing::debug!(
                token = token.0,
                why,
                "connection closed (not a proof of death)"
            );
            self.metrics.connections.set(self.connections.len() as i64);
            if let Some(key) = connection.peer.key {
                self.processes.release(key);
            }
            // Off the loop: the files still queued in a Unix socket go with it.
            closer::close_stream(connection.stream);
            self.dirty.remove(&token);
            self.read_again.remove(&token);
            self.input(Input::Disconnected {
                conn: conn_id(token),
            });
        }
    }

    /// Reads and answers what `token` sent. `peer_closed`: the readiness event said the
    /// peer shut its side, so the end of the stream is queued and must be read even
    /// after a short read.
    pub(super) fn read_connection(&mut self, token: Token, peer_closed: bool) {
        self.read_connection_frames(token, peer_closed);
        let now = self.turn_started;
        if let Some(connection) = self.connections.get_mut(&token) {
            let memory = connection.settle(now);
            let counted = std::mem::replace(&mut connection.counted_memory, memory);
            if memory != counted {
                self.count_memory(counted, memory);
            }
        }
    }

    /// Counts a connection's buffers, counted at `counted` bytes so far, at `memory` in
    /// the total of every connection's; past the budget the largest connection of the uid
    /// holding the most is cut (row 49), so peers that keep partial frames or unread
    /// replies cannot hold the server's memory, nor make it cut another uid's
    /// connections. (A ping's buffers keep their size: nothing to count.)
    pub(super) fn count_memory(&mut self, counted: usize, memory: usize) {
        self.buffered_bytes = self.buffered_bytes - counted + memory;
        if self.buffered_bytes <= self.buffer_budget {
            return;
        }
        let Some((largest, heaviest)) = self.heaviest(|connection| connection.counted_memory)
        else {
            return;
        };
        tracing::warn!(
            token = largest.0,
            uid = heaviest,
            buffered_bytes = self.buffered_bytes,
            buffer_budget = self.buffer_budget,
            "connection buffers exceed their budget (frames not yet whole, replies not yet \
             read): closing the largest connection of the uid whose connections hold the most"
        );
        self.cut(self.transport_name(largest), "memory_budget");
        self.close(largest, "buffer budget exceeded");
    }

    /// Counts a connection the server cut, by transport and reason
    /// (`kvwarden_connections_cut_total`).
    pub(super) fn cut(&self, transport: &'static str, reason: &'static str) {
        self.metrics.connection_cut(transport, reason);
    }

    fn transport_name(&self, token: Token) -> &'static str {
        match self.connections.get(&token).map(|c| &c.stream) {
            Some(PeerSocket::Tcp(_)) => "tcp",
            _ => "unix",
        }
    }

    /// Closes `token` (which holds more fds than one read brings: fewer need no
    /// judging) when it holds more fds than one frame may carry, or when the fds
    /// all connections hold for frames not yet complete exceed the budget (then the
    /// largest holder of the uid holding the most goes): true when `token` was closed.
    fn enforce_fd_bounds(&mut self, token: Token) -> bool {
        let Some(held) = self.connections.get(&token).map(Connection::held_fds) else {
            return true;
        };
        let cap = MAX_HELD_FDS.min(self.fd_transit_budget);
        if held > cap {
            tracing::warn!(
                token = token.0,
                held_fds = held,
                max_held_fds = cap,
                "closing a connection that sent more fds than one frame may carry \
                 without completing the frame (its fds are closed)"
            );
            self.cut(self.transport_name(token), "fds_held");
            self.close(token, "too many fds held");
            return true;
        }
        let total: usize = self.connections.values().map(Connection::held_fds).sum();
        if total <= self.fd_transit_budget {
            return false;
        }
        let Some((largest, uid)) = self.heaviest(Connection::held_fds) else {
            return false;
        };
        tracing::warn!(
            token = largest.0,
            uid,
            held_fds_total = total,
            fd_budget = self.fd_transit_budget,
            "fds held for incomplete frames exceed the budget: closing the largest holder of \
             the uid holding the most"
        );
        self.cut(self.transport_name(largest), "fd_budget");
        self.close(largest, "fd budget exceeded");
        largest == token
    }

    /// The largest connection (by `weight`) of the uid whose connections weigh the most
    /// together (TCP peers are one uid), and that uid: what a budget cuts, so that one
    /// uid's load never costs another uid its connection.
    fn heaviest(&self, weight: impl Fn(&Connection) -> usize) -> Option<(Token, Option<u32>)> {
        let mut by_uid: HashMap<Option<u32>, usize> = HashMap::default();
        for connection in self.connections.values() {
            *by_uid.entry(connection.peer.uid).or_default() += weight(connection);
        }
        let (&uid, _) = by_uid.iter().max_by_key(|(_, total)| **total)?;
        self.connections
            .iter()
            .filter(|(_, connection)| connection.peer.uid == uid)
            .max_by_key(|(_, connection)| weight(connection))
            .map(|(token, _)| (*token, uid))
    }

    /// Cuts every connection whose frame (or HTTP request) has been arriving for
    /// longer than the frame timeout, and every HTTP connection not answered within it:
    /// slow or stalled peers hold no slot for long (rows 42 and 43). Idle connections
    /// between frames are never cut: a worker that only pings keeps its connection.
    pub(super) fn sweep_deadlines(&mut self) {
        let now = self.turn_started;
        if now.saturating_duration_since(self.last_sweep) < SWEEP_EVERY {
            return;
        }
        self.last_sweep = now;
        let timeout = self.config.frame_timeout;
        let overdue: Vec<Token> = self
            .connections
            .iter()
            .filter(|(_, connection)| !connection.close_after_flush)
            .filter(|(_, connection)| connection.frame_overdue(now, timeout))
            .map(|(token, _)| *token)
            .collect();
        for token in overdue {
            tracing::warn!(
                token = token.0,
                frame_timeout_seconds = timeout.as_secs_f64(),
                "closing a connection whose frame did not arrive whole within \
                 --frame-timeout-seconds (a slow or stalled peer)"
            );
            self.cut(self.transport_name(token), "frame_timeout");
            self.close(token, "frame timeout");
        }
        let stale: Vec<Token> = self
            .http_connections
            .iter()
            .filter(|(_, connection)| now.saturating_duration_since(connection.accepted) > timeout)
            .map(|(token, _)| *token)
            .collect();
        for token in stale {
            self.cut("http", "frame_timeout");
            self.close_http(token);
        }
    }

    fn read_connection_frames(&mut self, token: Token, peer_closed: bool) {
        if self.node.is_shutting_down() {
            return;
        }
        let mut budget = FRAMES_PER_TURN;
        loop {
            budget = budget.saturating_sub(self.process_frames(token, budget));
            if budget == 0 {
                // A peer that keeps sending gets its turn again after everyone else's.
                self.read_again.insert(token);
                return;
            }
            let Some(connection) = self.connections.get_mut(&token) else {
                return;
            };
            if connection.close_after_flush {
                return;
            }
            let read = connection.read();
            let held_fds = connection.held_fds();
            // A read may have brought fds: past a bound, the connection is closed.
            if read.is_ok() && held_fds > JUDGED_AFTER_FDS && self.enforce_fd_bounds(token) {
                return;
            }
            match read {
                Ok(SocketRead::WouldBlock) => return,
                Ok(SocketRead::Drained) if !peer_closed => {
                    // The queue is empty: answer what came, and wait for the next event.
                    if self.process_frames(token, budget) >= budget {
                        self.read_again.insert(token);
                    }
                    return;
                }
                Ok(SocketRead::Data | SocketRead::Drained | SocketRead::Full) => {}
                Ok(SocketRead::Closed) => {
                    // The peer may only have shut down its write side (a half-close) and
                    // still read: answer what it sent, close once the replies are out.
                    self.process_frames(token, budget);
                    if let Some(connection) = self.connections.get_mut(&token) {
                        connection.close_after_flush = true;
                        self.dirty.insert(token);
                    }
                    return;
                }
                Err(error) => {
                    self.close(token, &format!("read failed: {error}"));
                    return;
                }
            }
        }
    }

    /// Handles up to `budget` buffered frames; returns how many it handled.
    pub(super) fn process_frames(&mut self, token: Token, budget: usize) -> usize {
        let mut handled = 0;
        while handled < budget {
            let max = self.config.max_frame_bytes;
            let Some(connection) = self.connections.get_mut(&token) else {
                return handled;
            };
            if connection.close_after_flush {
                return handled;
            }
            handled += 1;
            match connection.next_frame(max, decode_request) {
                Ok(None) => return handled - 1,
                Ok(Some(frame)) => self.handle_frame(token, frame),
                Err(error) => {
                    let code = match error {
                        FrameError::Empty => ErrorCode::BadFrame,
                        FrameError::TooLarge { .. } => ErrorCode::TooLarge,
                    };
                    tracing::warn!(token = token.0, %error, "closing a connection whose framing broke");
                    let error = ProtocolError::new(code, error.to_string());
                    self.reply(token, 0, "frame", Err(error));
                }
            }
        }
        handled
    }

    pub(super) fn reply(
        &mut self,
        token: Token,
        request_id: u64,
        op: &str,
        result: Result<Value, ProtocolError>,
    ) {
        if let Err(error) = &result {
            self.metrics.error(op, error.code.as_str());
        }
        let Some(connection) = self.connections.get_mut(&token) else {
            return; // the peer left; nobody to answer
        };
        if let Err(error) = &result
            && error.code.closes_connection()
        {
            connection.close_after_flush = true;
        }
        if connection.queue_reply(request_id, &result) {
            self.dirty.insert(token);
        } else {
            tracing::warn!(
                token = token.0,
                "disconnecting a peer that does not read its replies (output buffer full)"
            );
            self.close(token, "output buffer full");
        }
    }

    /// A reply that carries the L1 pool's memfd (`SCM_RIGHTS`): engine-driven
    /// registrations, `refreshed` too (a recovering worker may have lost its mapping).
    pub(super) fn reply_with_pool_fd(
        &mut self,
        token: Token,
        request_id: u64,
        op: &str,
        value: Value,
    ) {
        let fd = match self.l1.pool_fd().try_clone_to_owned() {
            Ok(fd) => fd,
            Err(error) => {
                let error = ProtocolError::new(
                    ErrorCode::Internal,
                    format!(
                        "register_engine_driven: duplicating the L1 pool's fd failed ({error}); \
                         the server may be out of file descriptors; retry later"
                    ),
                );
                self.reply(token, request_id, op, Err(error));
                return;
            }
        };
        let result = Ok(value);
        let Some(connection) = self.connections.get_mut(&token) else {
            return; // the peer left; the fd closes here
        };
        if !connection.has_room_for_fd_reply() {
            // Replies pipelined within one loop turn: send what the socket takes now,
            // so that only a peer that does not read is ever cut off.
            if let Err(error) = connection.flush() {
                self.close(token, &format!("write failed: {error}"));
                return;
            }
        }
        let Some(connection) = self.connections.get_mut(&token) else {
            return;
        };
        if connection.queue_reply_with_fds(request_id, &result, vec![fd]) {
            self.dirty.insert(token);
        } else {
            tracing::warn!(
                token = token.0,
                "disconnecting a peer that does not read its replies (output buffer or \
                 pool-fd replies queued full)"
            );
            self.close(token, "output full");
        }
    }

    /// Sends each connection's waiting replies: one send per connection, unless a
    /// reply carries fds (it goes on a `sendmsg` of its own) or the socket buffer
    /// fills (the rest waits for writable readiness, asked for only then).
    pub(super) fn flush_dirty(&mut self) {
        let mut dirty = std::mem::take(&mut self.flushing);
        dirty.extend(self.dirty.drain());
        for token in dirty.drain(..) {
            let Some(connection) = self.connections.get_mut(&token) else {
                continue;
            };
            let running = self.node.in_flight(conn_id(token));
            match connection.flush() {
                Ok(())
                    if connection.close_after_flush && !connection.has_output() && running == 0 =>
                {
                    self.close(token, "closed after its last reply");
                }
                Ok(()) => {
                    connection.shrink_output();
                    let memory = connection.memory();
                    let counted = std::mem::replace(&mut connection.counted_memory, memory);
                    let waiting = connection.has_output();
                    if waiting != connection.writable_interest {
                        let interest = if waiting {
                            Interest::READABLE | Interest::WRITABLE
                        } else {
                            Interest::READABLE
                        };
                        match self.poll.registry().reregister(
                            connection.stream.source(),
                            token,
                            interest,
                        ) {
                            Ok(()) => connection.writable_interest = waiting,
                            Err(error) => self
                                .close(token, &format!("asking for writability failed: {error}")),
                        }
                    }
                    if memory != counted {
                        self.count_memory(counted, memory);
                    }
                }
                Err(error) => self.close(token, &format!("write failed: {error}")),
            }
        }
        self.flushing = dirty;
    }
}

/// The node's name of a connection: its token.
pub(super) fn conn_id(token: Token) -> ConnId {
    ConnId(token.0 as u64)
}

/// The token of a connection the node names.
pub(super) fn token_of(conn: ConnId) -> Token {
    Token(usize::try_from(conn.0).unwrap_or(usize::MAX))
}
