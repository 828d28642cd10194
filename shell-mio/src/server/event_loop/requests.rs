//! Requests: decoded here, judged by the node. Only what needs the shell's hands stays
//! here: decode errors, and the pidfd a `hello` carries (where it may be is the node's
//! rule; the shell checks the fd with the kernel, then adopts it as the connection's
//! process before the node sees the `hello`).

use super::Server;
use super::connections::conn_id;
use crate::protocol::ErrorCode;
use crate::protocol::ProtocolError;
use crate::protocol::{DecodeError, Op, Request};
use crate::server::closer::PeerFd;
use crate::server::connection::Frame;
use crate::server::peer;
use kvwarden_core::node::Input;
use mio::Token;

impl Server {
    /// A frame decoded in place in the connection's input buffer ([`decode_request`]).
    pub(super) fn handle_frame(
        &mut self,
        token: Token,
        frame: Frame<Result<Request, DecodeError>>,
    ) {
        let request = match frame.body {
            Ok(request) => request,
            Err(error) => {
                self.metrics.invalid_request();
                let request_id = error.request_id.unwrap_or(0);
                self.reply(token, request_id, "invalid", Err(error.error));
                return;
            }
        };
        let name = request.op.name();
        self.metrics.request(request.op.index());
        let conn = conn_id(token);
        let mut fds = frame.fds;
        if let Op::Hello {
            protocol,
            ref client,
            pidfd_index,
            sends_fds,
            token: _,
            proof: _,
            wait_ms: _,
        } = request.op
        {
            tracing::debug!(protocol, client = %client, ?pidfd_index, sends_fds, "hello");
            if let Some(index) = pidfd_index {
                match self.adopt_peer_pidfd(token, index, std::mem::take(&mut fds)) {
                    Ok(Some((process, notice))) => self.input(Input::PeerProcess {
                        conn,
                        process,
                        notice,
                    }),
                    Ok(None) => {}
                    Err(error) => {
                        self.reply(token, request.id, name, Err(error));
                        return;
                    }
                }
            }
        }
        let ping = matches!(request.op, Op::Ping { .. });
        let started = std::time::Instant::now();
        let count = fds.len();
        if count > 0 {
            self.fd_stash.insert((conn, request.id), fds);
        }
        // One clock read serves the node's `now` and the ping's latency metric.
        self.input_at(
            self.instant_of(started),
            Input::Request {
                conn,
                request_id: request.id,
                op: request.op,
                fds: count,
            },
        );
        // What `Job::Build` did not take is closed now.
        self.fd_stash.clear();
        if ping {
            self.metrics
                .ping_seconds
                .observe(started.elapsed().as_secs_f64());
        }
    }

    /// Takes the pidfd the peer sent of itself with `hello` (fd `index` of the frame)
    /// as this connection's proof of death, once it checks out: its key for the node.
    /// Where the pidfd may be, and whether it may come at all, is the node's rule
    /// (`Node::hello_pidfd`); what the fd is, the kernel's (`peer::check_peer_pidfd`).
    fn adopt_peer_pidfd(
        &mut self,
        token: Token,
        index: u64,
        mut fds: Vec<PeerFd>,
    ) -> Result<Option<(kvwarden_core::node::ProcessKey, peer::DeathNotice)>, ProtocolError> {
        let bad_args = |message: String| ProtocolError::new(ErrorCode::BadArgs, message);
        let Some(position) = self.node.hello_pidfd(conn_id(token), index, fds.len())? else {
            return Ok(None);
        };
        let Some(connection) = self.connections.get_mut(&token) else {
            return Ok(None);
        };
        let pidfd = fds.swap_remove(position);
        let process =
            peer::check_peer_pidfd(&connection.peer, &pidfd, index, token).map_err(bad_args)?;
        tracing::debug!(token = token.0, pid = ?process.pid, key = ?process.key, "peer sent its pidfd");
        connection.peer.pidfd = Some(pidfd.into_checked());
        connection.peer.pidfd_from_peer = true;
        connection.peer.process = Some(process);
        let previous = connection.peer.key.take();
        let notice = connection.peer.death_notice();
        let key = self.processes.hold(process);
        if let Some(connection) = self.connections.get_mut(&token) {
            connection.peer.key = Some(key);
        }
        if let Some(previous) = previous {
            self.processes.release(previous);
        }
        Ok(Some((key, notice)))
    }
}
