//! The node's outputs, each carried out by the simulated shell.

use super::{Call, Server, ServerOut, ServerState, Step};
use crate::invariants::Checker;
use crate::time::Nanos;
use kvwarden_core::node::{Node, Output};
use rmpv::Value;

impl Server {
    /// Carries out one output of the node's call `call`.
    pub(super) fn carry_out(
        &mut self,
        now: Nanos,
        output: Output,
        call: &Call,
        checker: &mut Checker,
        out: &mut ServerOut,
        step: &mut Step,
    ) {
        match output {
            Output::Reply {
                conn,
                request_id,
                result,
                ..
            } => self.answer(conn, request_id, result, checker, out),
            Output::ReplyStatus { conn, request_id } => {
                let tracked = self.node.as_ref().map_or(0, Node::tracked) as u64;
                let value = Value::Map(vec![("tracked".into(), tracked.into())]);
                self.reply(conn, request_id, Ok(value), out);
            }
            Output::Job(job) => self.on_job(now, job, call, checker, out, step),
            Output::Blend(change) => self.on_blend(change, checker),
            Output::Peer(action) => self.on_peer(action, step),
            Output::L2(request) => self.on_l2(request, call, checker, out),
            Output::Note(note) => self.on_note(now, note, call, checker, step),
            Output::Stopped { .. } => {
                self.state = ServerState::Stopped;
                checker.stopped();
            }
            // The simulated server configures no node-scoped stream (`kv_publish`
            // is empty): the node publishes for none.
            Output::Publish { stream, .. } => checker.fail(
                crate::violation::Class::Safety,
                "unconfigured_stream",
                format!("the node published on stream {stream}, which nobody configured"),
            ),
        }
    }
}
