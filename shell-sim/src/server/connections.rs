//! The simulated server's connections: accepted, closed, and their bytes read into
//! requests for the node.

use super::{Asked, Call, Input, Publishing, Server, ServerOut};
use crate::invariants::{Checker, TenantRead, Verdict};
use crate::message::{Channel, Envelope, HANDSHAKE_ID, Payload, ReplyEnvelope};
use crate::time::Nanos;
use kvwarden_core::Module;
use kvwarden_core::node::{
    Built, ConnId, ContextId, CopyId, DeathNotice, FreeId, Input as NodeInput, ProcessKey,
    Transport,
};
use kvwarden_core::protocol::{ErrorCode, Op, ProtocolError};

impl Server {
    /// The connection of a worker process in this boot, opened (`Connected`, then the
    /// client's `attach`) on its first message; None for a message of a connection the
    /// process has replaced (lost with it).
    pub(super) fn conn(
        &mut self,
        now: Nanos,
        envelope: &Envelope,
        checker: &mut Checker,
        out: &mut ServerOut,
    ) -> Option<ConnId> {
        let key = (envelope.slot, envelope.incarnation, envelope.channel);
        match self.conns.get(&key) {
            Some(&(epoch, conn)) if epoch == envelope.epoch => return Some(conn),
            Some(&(epoch, _)) if epoch > envelope.epoch => return None,
            Some(&(_, old)) => {
                // The client reconnected: its old connection closes.
                self.conns.remove(&key);
                self.close(now, old, checker, out);
            }
            None => {}
        }
        self.next_conn += 1;
        let conn = ConnId(self.next_conn);
        self.conns.insert(key, (envelope.epoch, conn));
        self.peers
            .insert(conn, (envelope.slot, envelope.incarnation, envelope.tcp));
        let (uid, transport) = if envelope.tcp {
            (None, Transport::Tcp)
        } else {
            (Some(envelope.uid), Transport::Unix)
        };
        let process = (envelope.same_host && !envelope.tcp)
            .then_some((ProcessKey(envelope.instance.get()), DeathNotice::PidfdByPid));
        let input = NodeInput::Connected {
            conn,
            uid,
            transport,
            process,
        };
        checker.connected(conn.0, uid);
        self.call(now, Some(input), Call::Other, checker, out);
        if let Some(secret) = envelope.secret {
            self.stats.attaches += 1;
            let op = Op::Attach {
                instance: envelope.instance,
                secret: secret.to_vec(),
            };
            let request_id = HANDSHAKE_ID + u64::from(envelope.epoch);
            self.feed(now, conn, envelope, request_id, op, 0, checker, out);
        }
        Some(conn)
    }

    /// A connection closes (`Disconnected`).
    pub(super) fn close(
        &mut self,
        now: Nanos,
        conn: ConnId,
        checker: &mut Checker,
        out: &mut ServerOut,
    ) {
        self.peers.remove(&conn);
        self.tenant_reads.retain(|&(c, _), _| c != conn.0);
        let input = NodeInput::Disconnected { conn };
        self.call(now, Some(input), Call::Other, checker, out);
        checker.disconnected(conn.0);
    }

    pub(super) fn read(
        &mut self,
        now: Nanos,
        input: Input,
        checker: &mut Checker,
        out: &mut ServerOut,
    ) {
        if self.node.is_none() {
            return;
        }
        match input {
            Input::Request(envelope) => self.request(now, envelope, checker, out),
            Input::BuildDone { context, failed } => {
                self.build_done(now, context, failed, checker, out)
            }
            Input::CopyDone(copy) => self.copy_done(now, copy, checker, out),
            Input::BlendDone(blend) => {
                let input = NodeInput::BlendDone {
                    blend: kvwarden_core::node::blend::BlendId(blend),
                    result: Ok(()),
                };
                self.call(now, Some(input), Call::Other, checker, out);
            }
            Input::FreeDone(free) => {
                let free = FreeId(free);
                if let Some(context) = self.frees.remove(&free) {
                    checker.released(context);
                }
                self.free_runs.remove(&free);
                self.call(
                    now,
                    Some(NodeInput::FreeDone { free }),
                    Call::Other,
                    checker,
                    out,
                );
            }
            Input::PoolDone(job) => self.pool_done(now, job, checker, out),
            Input::Closed { slot, incarnation } => {
                for channel in [Channel::Main, Channel::Raw] {
                    if let Some((_, conn)) = self.conns.remove(&(slot, incarnation, channel)) {
                        self.close(now, conn, checker, out);
                    }
                }
            }
            Input::L2Done { job, fate } => {
                if let Some(input) = self.l2_done(job, fate, checker) {
                    self.call(now, Some(input), Call::Other, checker, out);
                }
            }
            Input::ExitNotice(instance) => {
                let process = ProcessKey(instance.get());
                if self.watched.contains(&process) {
                    let input = NodeInput::ProcessExited { process };
                    self.call(now, Some(input), Call::Exit(instance), checker, out);
                }
            }
        }
    }

    /// A build reports back: the node gets the buffers' lengths, or the failure.
    fn build_done(
        &mut self,
        now: Nanos,
        context: u64,
        failed: bool,
        checker: &mut Checker,
        out: &mut ServerOut,
    ) {
        let context = ContextId(context);
        let Some((key, buffer_lens)) = self.builds.remove(&context) else {
            return;
        };
        let result = if failed {
            Err(ProtocolError::new(
                ErrorCode::Internal,
                "simulated build failure (mmap refused)",
            ))
        } else {
            Ok(match key.1 {
                Module::ServerDriven => Built::ServerDriven { buffer_lens },
                Module::EngineDriven => Built::EngineDriven,
            })
        };
        let call = Call::BuildDone {
            key,
            context,
            failed,
        };
        self.call(
            now,
            Some(NodeInput::BuildDone { context, result }),
            call,
            checker,
            out,
        );
    }

    /// A copy reports back: its bytes are published (a store's), its slot's write done.
    fn copy_done(&mut self, now: Nanos, copy: u64, checker: &mut Checker, out: &mut ServerOut) {
        let copy = CopyId(copy);
        if let Some(context) = self.copies.remove(&copy) {
            checker.copy_done(context);
        }
        if let Some(slot) = self.pool_writes.remove(&copy.0)
            && let Some(pool) = self.pool.as_mut()
        {
            pool.write_done(slot, self.store_copies.get(&copy.0).cloned());
        }
        if let Some(key) = self.store_copies.remove(&copy.0) {
            // The copy completed: the slot holds the key's published bytes.
            checker.published(key);
        }
        let input = NodeInput::CopyDone {
            copy,
            result: Ok(crate::worker::STORE_BYTES),
        };
        self.call(now, Some(input), Call::CopyDone, checker, out);
    }

    pub(super) fn request(
        &mut self,
        now: Nanos,
        mut envelope: Envelope,
        checker: &mut Checker,
        out: &mut ServerOut,
    ) {
        let Some(conn) = self.conn(now, &envelope, checker, out) else {
            return; // it travelled on a connection the process has closed
        };
        let (request_id, op, fds) =
            match std::mem::replace(&mut envelope.payload, Payload::Bytes(Vec::new())) {
                Payload::Op { id, op, fds } => (id, op, fds),
                Payload::Decoded(Ok(request)) => (request.id, request.op, 0),
                Payload::Decoded(Err(error)) => {
                    // As the production shell: the decode error is the reply; a frame that
                    // cannot be trusted closes that connection only.
                    self.stats.decode_errors += 1;
                    let request_id = error.request_id.unwrap_or(0);
                    let code = error.error.code;
                    if code == ErrorCode::BadArgs {
                        self.stats.bad_args += 1;
                    }
                    out.replies.push(ReplyEnvelope {
                        slot: envelope.slot,
                        incarnation: envelope.incarnation,
                        boot: self.boot,
                        request_id,
                        result: Err(error.error),
                    });
                    if code.closes_connection() {
                        self.stats.connections_closed += 1;
                        let key = (envelope.slot, envelope.incarnation, envelope.channel);
                        self.conns.remove(&key);
                        self.close(now, conn, checker, out);
                    }
                    return;
                }
                Payload::Bytes(_) => return, // decoded on arrival; never here
            };
        self.feed(now, conn, &envelope, request_id, op, fds, checker, out);
    }

    /// Hands one request to the node, judged first by the trust rules' reference model.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn feed(
        &mut self,
        now: Nanos,
        conn: ConnId,
        envelope: &Envelope,
        request_id: u64,
        op: Op,
        fds: usize,
        checker: &mut Checker,
        out: &mut ServerOut,
    ) {
        let verdict = checker.verdict(conn.0, &op);
        let instance = op.instance();
        let allowed = verdict == Verdict::Allowed;
        let mut publish: Publishing = (Vec::new(), false);
        if allowed && let Some(prefix) = checker.tenant_prefix(conn.0) {
            let scoped = |key: &[u8]| {
                let mut scoped = prefix.to_vec();
                scoped.extend_from_slice(key);
                scoped
            };
            publish = match &op {
                Op::Store { key, .. } => (vec![scoped(key)], false),
                Op::CommitStore { key, .. } => (vec![scoped(key)], true),
                Op::StoreBatch { items, .. } => {
                    (items.iter().map(|item| scoped(&item.key)).collect(), false)
                }
                _ => (Vec::new(), false),
            };
            let read = match &op {
                Op::Retrieve { key, .. } => Some((vec![key.clone()], false)),
                Op::RetrieveBatch { items, .. } => {
                    Some((items.iter().map(|item| item.key.clone()).collect(), false))
                }
                Op::Lookup { keys } => Some((keys.clone(), true)),
                _ => None,
            };
            if let Some((keys, lookup)) = read {
                let read = TenantRead {
                    prefix: prefix.to_vec(),
                    keys,
                    lookup,
                };
                self.tenant_reads
                    .insert((conn.0, request_id), (op.name(), read));
            }
        }
        let reads = matches!(op, Op::Retrieve { .. } | Op::PrepareRetrieve { .. });
        let before = match verdict {
            Verdict::Refused(_) => {
                instance.map(|named| (self.entries(named), self.blend.contains(&named)))
            }
            _ => None,
        };
        let call = Call::Request {
            conn,
            request_id,
            name: op.name(),
            instance,
            asked: Asked::of(&op),
            // The clean shutdown's last word is about the process's own instance.
            exiting: envelope.exiting && instance == Some(envelope.instance),
            verdict,
            before,
            reads,
            publish,
        };
        let input = NodeInput::Request {
            conn,
            request_id,
            op,
            fds,
        };
        self.call(now, Some(input), call, checker, out);
    }
}
