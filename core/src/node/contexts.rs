//! Contexts: what each built context is, the engine-driven strategy it carries, and
//! the copies running against it, a copy's start and end together.
//!
//! The rule it owns: a context is not freed while a copy uses it. A free decided while
//! copies run is deferred ([`Contexts::defer_free`]) and handed back by the end of the
//! last copy ([`Contexts::end_copy`]), so the node starts it then.

use super::engine::TransferStrategy;
use super::io::{Built, ContextId, CopyId};
use super::l1::SlotId;
use super::{HashMap, ReplyTo};
use crate::FreeCause;
use crate::id::InstanceId;
use crate::module::Module;

/// A free decided while copies ran: whose, which module, why, and its label.
pub(super) type DeferredFree = (InstanceId, Module, FreeCause, &'static str);

/// What a copy is for: the request it answers, or a batch's item.
pub(super) enum CopyFor {
    Store(ReplyTo),
    Retrieve(ReplyTo),
    BatchStore { batch: u64, item: usize },
    BatchRetrieve { batch: u64, item: usize },
}

/// A copy in flight.
pub(super) struct CopyInFlight {
    pub(super) context: ContextId,
    pub(super) slot: SlotId,
    pub(super) purpose: CopyFor,
}

/// A built context's metadata.
struct ContextInfo {
    built: Built,
    /// Copies running against it; its free waits for them.
    copies: u32,
    /// The free decided while copies ran.
    deferred: Option<DeferredFree>,
}

/// The built contexts, their strategies and the copies against them.
#[derive(Default)]
pub(super) struct Contexts {
    contexts: HashMap<ContextId, ContextInfo>,
    strategies: HashMap<ContextId, TransferStrategy>,
    copies: HashMap<CopyId, CopyInFlight>,
}

impl Contexts {
    /// A context built: kept, with a fresh strategy when it is engine-driven.
    pub(super) fn insert(&mut self, context: ContextId, built: Built) {
        if matches!(built, Built::EngineDriven) {
            self.strategies.insert(context, TransferStrategy::default());
        }
        self.contexts.insert(
            context,
            ContextInfo {
                built,
                copies: 0,
                deferred: None,
            },
        );
    }

    /// Whether `context` is built and not yet freed.
    pub(super) fn contains(&self, context: ContextId) -> bool {
        self.contexts.contains_key(&context)
    }

    /// What `context` was built as.
    pub(super) fn built(&self, context: ContextId) -> Option<&Built> {
        self.contexts.get(&context).map(|info| &info.built)
    }

    /// The engine-driven strategy of `context`.
    pub(super) fn strategy_mut(&mut self, context: ContextId) -> Option<&mut TransferStrategy> {
        self.strategies.get_mut(&context)
    }

    /// Takes `context`'s strategy away (its entry is being freed).
    pub(super) fn take_strategy(&mut self, context: ContextId) -> Option<TransferStrategy> {
        self.strategies.remove(&context)
    }

    /// Starts counting copy `copy` between `context` and `slot`: the context's free
    /// waits until [`Contexts::end_copy`] ends it.
    pub(super) fn start_copy(
        &mut self,
        copy: CopyId,
        context: ContextId,
        slot: SlotId,
        purpose: CopyFor,
    ) {
        if let Some(info) = self.contexts.get_mut(&context) {
            info.copies += 1;
        }
        self.copies.insert(
            copy,
            CopyInFlight {
                context,
                slot,
                purpose,
            },
        );
    }

    /// Ends `copy`'s count on its context: the copy, and the free deferred for it when
    /// it was the last.
    pub(super) fn end_copy(
        &mut self,
        copy: CopyId,
    ) -> Option<(CopyInFlight, Option<DeferredFree>)> {
        let ended = self.copies.remove(&copy)?;
        let deferred = match self.contexts.get_mut(&ended.context) {
            Some(info) => {
                info.copies = info.copies.saturating_sub(1);
                if info.copies == 0 {
                    info.deferred.take()
                } else {
                    None
                }
            }
            None => None,
        };
        Some((ended, deferred))
    }

    /// Defers `free` of `context` while copies use it; hands it back when none does
    /// (the node starts it now).
    pub(super) fn defer_free(
        &mut self,
        context: ContextId,
        free: DeferredFree,
    ) -> Result<(), DeferredFree> {
        match self.contexts.get_mut(&context) {
            Some(info) if info.copies > 0 => {
                info.deferred = Some(free);
                Ok(())
            }
            _ => Err(free),
        }
    }

    /// `context` is being freed: forgotten.
    pub(super) fn remove(&mut self, context: ContextId) {
        self.contexts.remove(&context);
        self.strategies.remove(&context);
    }

    /// Frees deferred until their context's copies end.
    pub(super) fn deferred_frees(&self) -> usize {
        self.contexts
            .values()
            .filter(|info| info.deferred.is_some())
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::super::io::ConnId;
    use super::*;
    use crate::protocol::OpKind;

    fn free() -> DeferredFree {
        (
            InstanceId::new(7).expect("a valid id"),
            Module::ServerDriven,
            FreeCause::Unregistered,
            "unregistered",
        )
    }

    fn retrieve() -> CopyFor {
        CopyFor::Retrieve(ReplyTo {
            conn: ConnId(1),
            request_id: 1,
            op: OpKind::Retrieve,
            deadline: None,
        })
    }

    #[test]
    fn a_free_waits_for_the_last_copy_and_is_handed_back_by_its_end() {
        let mut contexts = Contexts::default();
        let context = ContextId(3);
        contexts.insert(context, Built::EngineDriven);
        // Control: with no copy running, the free is not deferred.
        assert!(contexts.defer_free(context, free()).is_err());
        contexts.start_copy(CopyId(1), context, 0, retrieve());
        contexts.start_copy(CopyId(2), context, 1, retrieve());
        assert!(contexts.defer_free(context, free()).is_ok());
        assert_eq!(contexts.deferred_frees(), 1);
        let (_, first) = contexts.end_copy(CopyId(1)).expect("copy 1 runs");
        assert!(first.is_none(), "a copy still runs");
        let (ended, last) = contexts.end_copy(CopyId(2)).expect("copy 2 runs");
        assert_eq!(ended.slot, 1);
        assert_eq!(last, Some(free()));
        assert_eq!(contexts.deferred_frees(), 0);
        assert!(contexts.end_copy(CopyId(2)).is_none(), "ended once");
    }

    #[test]
    fn a_removed_context_takes_its_strategy_with_it() {
        let mut contexts = Contexts::default();
        contexts.insert(ContextId(1), Built::EngineDriven);
        contexts.insert(
            ContextId(2),
            Built::ServerDriven {
                buffer_lens: vec![8],
            },
        );
        assert!(contexts.strategy_mut(ContextId(1)).is_some());
        assert!(contexts.strategy_mut(ContextId(2)).is_none());
        contexts.remove(ContextId(1));
        assert!(!contexts.contains(ContextId(1)));
        assert!(contexts.strategy_mut(ContextId(1)).is_none());
    }
}
