//! A pool that outlives the process (failure modes 71–73): committed values are sealed,
//! and a restarted server adopts what its pool file still holds, slot by slot, while
//! it serves.
//!
//! The shell checks each seal ([`crate::seal`]); the node decides what a verified one
//! becomes: committed again under the tenant its key names, or dropped (no such tenant
//! now, or the key already adopted from another slot). A slot not scanned yet is
//! neither served nor free; a store that finds nothing else takes one, and its value is
//! lost (counted `taken`). Pins, reservations and engine-driven windows of the old
//! process are never adopted: only committed values were ever sealed.

#[cfg(feature = "planted-bugs")]
use crate::node::PlantedBug;
use crate::node::Scanned;
use crate::node::SlotId;
use crate::node::TenantId;
use crate::node::l1;
use crate::node::{Job, Node, Note};
use crate::time::Instant;
/// Bytes of the pool one scan job checks.
const SCAN_JOB_BYTES: u64 = 64 << 20;

/// The pseudo-tenant whose turn at the pool the scan jobs take: they wait in turns with
/// every tenant's copies, like a tenant of their own.
const SCANNER: TenantId = TenantId(u32::MAX);

/// What the adoption of a restarted server's pool did, for `/status`, the log and the
/// metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdoptionView {
    /// Slots in the pool.
    pub slots: usize,
    /// Slots scanned so far.
    pub scanned: usize,
    /// Values adopted (served again).
    pub adopted: u64,
    /// Their bytes.
    pub adopted_bytes: u64,
    /// Seals that did not verify: torn by a crash, overwritten, another secret's.
    pub dropped_torn: u64,
    /// Malformed seals.
    pub dropped_malformed: u64,
    /// Verified, but no tenant of the key's name may exist now.
    pub dropped_tenant: u64,
    /// Verified, but the key was adopted from another slot already.
    pub dropped_duplicate: u64,
    /// Taken by a store before their seal was checked.
    pub dropped_taken: u64,
    /// When the scan began and when it ended (None: still scanning).
    pub started: Instant,
    /// When the last slot was scanned.
    pub finished: Option<Instant>,
}

impl AdoptionView {
    /// Values dropped, for every reason.
    pub fn dropped(&self) -> u64 {
        self.dropped_torn
            + self.dropped_malformed
            + self.dropped_tenant
            + self.dropped_duplicate
            + self.dropped_taken
    }
}

/// The scan's progress.
#[derive(Debug)]
pub(super) struct AdoptionScan {
    view: AdoptionView,
}

impl Node {
    /// Makes L1 a pool that outlives the process (`--l1-file`): every value committed
    /// from now on is sealed (`seal`), and with `adopt` every slot is scanned first,
    /// those whose seal verifies served again. Called once, before any input.
    pub fn persist_pool(&mut self, now: Instant, seal: bool, adopt: bool) {
        if seal {
            self.l1.slots.seal_commits();
        }
        if !adopt || self.l1.adoption.is_some() {
            return;
        }
        let slots = self.l1.slots.num_slots();
        self.l1.slots.mark_unscanned();
        self.l1.adoption = Some(AdoptionScan {
            view: AdoptionView {
                slots,
                started: now,
                ..AdoptionView::default()
            },
        });
        let per_job = usize::try_from(SCAN_JOB_BYTES / self.config.slot_bytes.max(1))
            .unwrap_or(usize::MAX)
            .max(1);
        let mut first = 0;
        while first < slots {
            let count = per_job.min(slots - first);
            self.submit_for(SCANNER, Job::Scan { first, count });
            first += count;
        }
        if slots == 0 {
            self.adoption_finished(now);
        }
    }

    /// The adoption's figures, None when the pool was not adopted.
    pub fn adoption(&self) -> Option<&AdoptionView> {
        self.l1.adoption.as_ref().map(|adoption| &adoption.view)
    }

    /// Committed values go to their seal, pinned until `Sealed` (after every input).
    pub(super) fn seal_committed(&mut self) {
        for (slot, key, len) in self.l1.slots.take_seals() {
            let tenant = self.l1.slots.tenant_of(slot).unwrap_or(SCANNER);
            self.submit_for(tenant, Job::Seal { slot, key, len });
        }
    }

    pub(super) fn sealed(&mut self, slot: SlotId, written: bool) {
        self.job_reported();
        self.l1.slots.sealed(slot, written);
    }

    pub(super) fn scanned(&mut self, now: Instant, first: SlotId, found: Vec<Scanned>) {
        self.job_reported();
        let Some(mut adoption) = self.l1.adoption.take() else {
            return;
        };
        let view = &mut adoption.view;
        view.scanned += found.len();
        for (slot, finding) in (first..).zip(found) {
            #[cfg(feature = "planted-bugs")]
            if self.planted(PlantedBug::AdoptTaken) && matches!(finding, Scanned::Sealed { .. }) {
                self.l1.slots.forget_taken(slot);
            }
            let unscanned = self.l1.slots.is_unscanned(slot);
            match finding {
                // Nothing was there to lose, taken or not.
                Scanned::Blank => {}
                _ if !unscanned => view.dropped_taken += 1,
                Scanned::Unsealed(crate::seal::Unsealed::Torn) => view.dropped_torn += 1,
                Scanned::Unsealed(crate::seal::Unsealed::Malformed) => view.dropped_malformed += 1,
                Scanned::Sealed { key, len } => match self.doors.trust.tenant_of_key(&key) {
                    None => view.dropped_tenant += 1,
                    Some(tenant) => match self.l1.slots.adopt(slot, key, len, tenant) {
                        l1::Adoption::Adopted => {
                            view.adopted += 1;
                            view.adopted_bytes += len;
                        }
                        l1::Adoption::Duplicate => view.dropped_duplicate += 1,
                        l1::Adoption::Taken => view.dropped_taken += 1,
                    },
                },
            }
            // Whatever was not adopted leaves the slot free.
            self.l1.slots.scanned_empty(slot);
        }
        let done = view.scanned >= view.slots && view.finished.is_none();
        self.l1.adoption = Some(adoption);
        if done {
            self.adoption_finished(now);
        }
    }

    fn adoption_finished(&mut self, now: Instant) {
        let Some(adoption) = self.l1.adoption.as_mut() else {
            return;
        };
        adoption.view.finished = Some(now);
        let view = adoption.view.clone();
        self.note(Note::PoolAdopted(view));
    }
}
