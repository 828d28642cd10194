//! What the simulated shell checks around each node call: the outputs against the
//! reference model before they are carried out, and the registry reconciled after.

use super::{Asked, Call, Server};
use crate::invariants::{Checker, Verdict};
use crate::oracle::EntryKey;
use crate::time::{Nanos, nanos_of};
use kvwarden_core::node::Job;
use kvwarden_core::node::Output;
use kvwarden_core::protocol::{Answer, ErrorCode};
use kvwarden_core::{FreeCause, InstanceId, Module, TransferError};

impl Server {
    /// What the checker must know before the outputs are carried out: how the node
    /// answered the request (or took the build's outcome).
    pub(super) fn before_outputs(
        &mut self,
        now: Nanos,
        call: &Call,
        outputs: &[Output],
        checker: &mut Checker,
    ) {
        match call {
            Call::BuildDone {
                key,
                context,
                failed,
            } => {
                if *failed {
                    self.stats.builds_failed += 1;
                    checker.build_failed(now, *key, context.0);
                } else {
                    let id = checker.contexts.len() as u64;
                    checker.built(now, *key, context.0, id);
                    self.ledger.insert(*context, id);
                    self.stats.contexts_built += 1;
                }
            }
            Call::Request { .. } => self.request_judged(now, call, outputs, checker),
            Call::CopyDone | Call::Exit(_) | Call::Other => {}
        }
    }

    /// A request the node answered (or went on with): who is who, then what it did to
    /// the reference model.
    fn request_judged(
        &mut self,
        now: Nanos,
        call: &Call,
        outputs: &[Output],
        checker: &mut Checker,
    ) {
        let Call::Request {
            conn,
            name,
            instance,
            asked,
            verdict,
            before,
            ..
        } = call
        else {
            return;
        };
        let reply = reply_to(call, outputs);
        let code = reply.and_then(|r| r.as_ref().err()).map(|e| e.code);
        if code == Some(ErrorCode::Forbidden) && instance.is_some() {
            self.stats.forbidden += 1;
        }
        // Who is who first: a request the rules refuse is judged here in full.
        let served = checker.judge_trust(conn.0, name, *instance, verdict, reply);
        if let (Some(named), Some(before)) = (*instance, before)
            && code != Some(ErrorCode::Unavailable)
        {
            // (A shutdown frees everything, whoever asks.)
            let after = (self.entries(named), self.blend.contains(&named));
            checker.refused_left_alone(name, named, before, &after);
        }
        if *verdict == Verdict::OwnerRefused
            && code == Some(ErrorCode::Forbidden)
            && let Some(named) = *instance
        {
            // Refused for its tenant, but the owner's request: evidence of life.
            checker.evidence(now, named);
        }
        if let Call::Request {
            publish: (keys, true),
            ..
        } = call
            && reply == Some(&Ok(Answer::Flag(true)))
        {
            // A commit answered `true` published its key (a store's key is
            // published when its copy completes, never by its answer: `true`
            // for a key already there copied nothing).
            keys.iter().for_each(|key| checker.published(key.clone()));
        }
        let Some(instance) = *instance else {
            return;
        };
        if !served || code == Some(ErrorCode::Forbidden) {
            return;
        }
        if code == Some(ErrorCode::Unavailable) {
            return; // shutting down: refused before anything
        }
        if let Asked::Ping = asked {
            if reply.is_none() {
                checker.fail(
                    crate::violation::Class::Safety,
                    "ping_waited_for_l2",
                    format!(
                        "a ping of instance {instance} was not answered in the node call \
                         it was handed in (row 27: nothing a ping needs waits for L2)"
                    ),
                );
                return;
            }
            if let Some(Ok(Answer::Flag(tracked))) = reply {
                checker.ping(now, instance, *tracked);
            }
            return;
        }
        checker.evidence(now, instance);
        self.asked_judged(now, call, instance, outputs, checker);
    }

    /// What a served request of `instance` did: a registration, an unregistration or
    /// a transfer, told to the reference model.
    fn asked_judged(
        &mut self,
        now: Nanos,
        call: &Call,
        instance: InstanceId,
        outputs: &[Output],
        checker: &mut Checker,
    ) {
        let Call::Request { asked, exiting, .. } = call else {
            return;
        };
        let reply = reply_to(call, outputs);
        let code = reply.and_then(|r| r.as_ref().err()).map(|e| e.code);
        let transfer = |module: Module| -> Option<(EntryKey, Result<Option<u64>, TransferError>)> {
            let result = match code {
                Some(ErrorCode::NotRegistered) => Err(TransferError::NotRegistered),
                Some(ErrorCode::NotReady) => Err(TransferError::NotReady),
                _ => Ok(None),
            };
            Some(((instance, module), result))
        };
        let transfer = match asked {
            Asked::Register(module) => {
                let key = (instance, *module);
                let build = outputs.iter().find_map(|output| match output {
                    Output::Job(Job::Build {
                        context,
                        instance: i,
                        module: m,
                        ..
                    }) if (*i, *m) == key => Some(context.0),
                    _ => None,
                });
                match (build, code) {
                    (Some(serial), _) => checker.register(now, key, Some(serial)),
                    (None, Some(_)) => {} // refused for its arguments or load
                    (None, None) => checker.register(now, key, None),
                }
                None
            }
            Asked::Unregister(module) => {
                if let Some(Ok(Answer::Flag(was))) = reply {
                    checker.unregister(now, (instance, *module), *was, *exiting);
                }
                None
            }
            Asked::Transfer(module) => transfer(*module),
            Asked::Prepare(key) => {
                if let Some(Ok(Answer::Reserved(Some(_)))) = reply
                    && self
                        .reserved
                        .entry(instance)
                        .or_default()
                        .insert(key.clone())
                {
                    self.reserved_total += 1;
                }
                transfer(Module::EngineDriven)
            }
            Asked::Commit(key) => {
                if let Some(keys) = self.reserved.get_mut(&instance)
                    && keys.remove(key)
                {
                    self.reserved_total -= 1;
                }
                transfer(Module::EngineDriven)
            }
            Asked::Ping | Asked::Other => None,
        };
        if let Some((key, mut result)) = transfer {
            if let Ok(context) = &mut result {
                *context = outputs.iter().find_map(|output| match output {
                    Output::Job(Job::Copy { context, .. }) => self.ledger.get(context).copied(),
                    _ => None,
                });
            }
            checker.transfer(now, key, result);
        }
    }

    /// Entries the reference model holds and the node no longer does: reaps (the
    /// registry's counter says how many), or a shutdown's unregistering.
    pub(super) fn reconcile(
        &mut self,
        reaped_before: u64,
        freed: &[(EntryKey, FreeCause)],
        checker: &mut Checker,
    ) -> u64 {
        let Some(node) = self.node.as_ref() else {
            return 0;
        };
        let reaped = node.liveness_status().reaped_total - reaped_before;
        if reaped == 0 && checker.shadow_len() == node.tracked() {
            return 0;
        }
        let shutting_down = node.is_shutting_down();
        let gone: Vec<EntryKey> = checker
            .shadow_keys()
            .into_iter()
            .filter(|&(instance, module)| node.entry(instance, module).is_none())
            .collect();
        let cause_of = |key: EntryKey| {
            freed
                .iter()
                .find(|(freed_key, _)| *freed_key == key)
                .map(|(_, cause)| *cause)
        };
        let identified = gone
            .iter()
            .filter(|&&key| matches!(cause_of(key), Some(FreeCause::Reaped { .. })))
            .count() as u64;
        let mut unassigned = reaped.saturating_sub(identified);
        let mut list = Vec::with_capacity(gone.len());
        for key in gone {
            let entry = match cause_of(key) {
                Some(FreeCause::Reaped { silence, proven }) => {
                    (key, Some((nanos_of(silence), proven)), false)
                }
                Some(_) if shutting_down => (key, None, true),
                _ if unassigned > 0 => {
                    unassigned -= 1;
                    (key, None, false)
                }
                _ => (key, None, shutting_down),
            };
            list.push(entry);
        }
        checker.reaped(reaped, list);
        reaped
    }
}

/// The node's answer to the request `call` made, among `outputs`.
fn reply_to<'a>(
    call: &Call,
    outputs: &'a [Output],
) -> Option<&'a Result<Answer, kvwarden_core::protocol::ProtocolError>> {
    let Call::Request {
        conn, request_id, ..
    } = call
    else {
        return None;
    };
    outputs.iter().find_map(|output| match output {
        Output::Reply {
            conn: to,
            request_id: id,
            result,
            ..
        } if to == conn && id == request_id => Some(result),
        _ => None,
    })
}
