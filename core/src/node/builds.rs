//! Builds in flight: the context each one will give its entry, the REGISTER that
//! started it, and the REGISTERs that found it running (answered with its outcome,
//! decision 1).

use super::{BuildTicket, ContextId, HashMap, InstanceId, Module, ReplyTo};

/// A build the shell runs.
pub(super) struct PendingBuild {
    pub(super) ticket: BuildTicket,
    /// The REGISTER that started it.
    pub(super) reply: ReplyTo,
    /// REGISTERs that found this build running: answered with its outcome.
    pub(super) waiters: Vec<ReplyTo>,
}

/// Every build in flight, by its context and by the entry it builds for.
#[derive(Default)]
pub(super) struct Builds {
    pending: HashMap<ContextId, PendingBuild>,
    /// The build each entry's REGISTERs join while it runs.
    building: HashMap<(InstanceId, Module), ContextId>,
}

impl Builds {
    /// `context` is being built for the ticket's entry, for the REGISTER `reply`.
    pub(super) fn start(&mut self, context: ContextId, ticket: BuildTicket, reply: ReplyTo) {
        let entry = (ticket.instance(), ticket.module());
        let build = PendingBuild {
            ticket,
            reply,
            waiters: Vec::new(),
        };
        self.pending.insert(context, build);
        self.building.insert(entry, context);
    }

    /// A REGISTER of an entry being built waits for that build's outcome; false when
    /// no build of this node runs for the entry (it is answered now).
    pub(super) fn join(&mut self, instance: InstanceId, module: Module, waiter: ReplyTo) -> bool {
        let build = self
            .building
            .get(&(instance, module))
            .and_then(|context| self.pending.get_mut(context));
        match build {
            Some(build) => {
                build.waiters.push(waiter);
                true
            }
            None => false,
        }
    }

    /// The build of `context` ended: what it was, None when it is not this node's.
    pub(super) fn finish(&mut self, context: ContextId) -> Option<PendingBuild> {
        let build = self.pending.remove(&context)?;
        let entry = (build.ticket.instance(), build.ticket.module());
        if self.building.get(&entry) == Some(&context) {
            self.building.remove(&entry);
        }
        Some(build)
    }
}
