//! Connections: accepting, bounded reads, frames, replies and flushing.

use super::*;

impl Server {
    // ---------------------------------------------------------------- connections

    pub(super) fn admit(&mut self, mut stream: Stream, mut peer: crate::server::connection::Peer) {
        if self.connections.len() >= self.config.max_connections {
            tracing::warn!(
                max_connections = self.config.max_connections,
                "refusing a connection: --max-connections reached"
            );
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
            return;
        }
        let transport = match stream {
            Stream::Unix(_) => Transport::Unix,
            Stream::Tcp(_) => Transport::Tcp,
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
    }

    pub(super) fn accept_unix(&mut self) {
        loop {
            let Some(listener) = &self.unix_listener else {
                return;
            };
            match listener.accept() {
                Ok((stream, _)) => {
                    let peer = peer::peer_of(&stream);
                    self.admit(Stream::Unix(stream), peer);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!(error = %e, "accept on the Unix socket failed");
                    return;
                }
            }
        }
    }

    pub(super) fn accept_tcp(&mut self) {
        loop {
            let Some(listener) = &self.tcp_listener else {
                return;
            };
            match listener.accept() {
                Ok((stream, _)) => {
                    let _ = stream.set_nodelay(true);
                    self.admit(
                        Stream::Tcp(stream),
                        crate::server::connection::Peer::default(),
                    );
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!(error = %e, "accept on the TCP socket failed");
                    return;
                }
            }
        }
    }

    pub(super) fn close(&mut self, token: Token, why: &str) {
        if let Some(mut connection) = self.connections.remove(&token) {
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
            match connection.read() {
                Ok(ReadOutcome::WouldBlock) => return,
                Ok(ReadOutcome::Drained) if !peer_closed => {
                    // The queue is empty: answer what came, and wait for the next event.
                    if self.process_frames(token, budget) >= budget {
                        self.read_again.insert(token);
                    }
                    return;
                }
                Ok(ReadOutcome::Data | ReadOutcome::Drained | ReadOutcome::Full) => {}
                Ok(ReadOutcome::Closed) => {
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
