//! The invariants, checked at every step of a run; the first violation stops it.
//!
//! The simulated shell (`crate::server`) drives the real node and reports here what it
//! learned from the node's outputs and replies: ping answers, REGISTERs that started a
//! build (or refreshed), transfer answers, UNREGISTER answers, process exits, stalls,
//! `Job::Free` (a context given back) and `FreeDone` (released), copies started and
//! done, reaps (the registry's counter and the entries gone). The checker compares that
//! against the reference model ([`crate::oracle`]) and keeps the context ledger.
//! Invariants:
//!
//! | name | class | what |
//! |---|---|---|
//! | `reaped_early` | safety | a reap whose silence (stall-corrected) is ≤ the window |
//! | `live_worker_reaped` | safety | a reap although a ping, register or transfer of the instance (any module) reached the server's socket within the window |
//! | `reaped_in_part` | safety | a reap that left another entry of the same instance held (row 26: an instance lives and dies whole) |
//! | `ping_true_for_part` | safety | a ping answered `true` while the worker holds fewer registrations than it made (and did not unregister, and was not told were gone) |
//! | `reaped_while_disabled` | safety | a reap with T = 0 |
//! | `double_free` | safety | a context freed twice, or used after its free |
//! | `two_contexts` | safety | one (instance, module) holding two live contexts |
//! | `ghost_context` | safety | an entry created for an instance after its clean shutdown's UNREGISTER |
//! | `blend_without_entry` | safety | blend state of an instance with no entry |
//! | `pin_of_freed_instance` | safety | a pin or reservation owned by a freed context |
//! | `free_during_copy` | safety | a free started while a copy still uses the context |
//! | `ping_waited_for_l2` | safety | a ping not answered in the node call it was handed in (row 27: nothing a ping needs waits for L2 or anything else) |
//! | `l2_unpublished` | safety | an `L2Request::Write` of a key never published: no store's copy into L1 completed and no `commit_store` was answered `true` for it (row 29: an engine-driven reservation never committed, a copy cut short) |
//! | `sealed_other_bytes`, `served_torn`, `served_other_value`, `adopted_other_bytes`, `unasked_persistence` | safety | the pool file (rows 71–72), checked by the shell against [`crate::pool`]: a seal over bytes not its key's, a read from a torn slot or one holding another key's value, an adoption over a slot that holds another value, a seal or scan without a pool file |
//! | `non_owner_served` | safety | a request the trust rules refuse (its connection never attached the instance it names with its secret, a TCP peer without the token, a wrong-secret `attach`, an untrusted tenant's engine-driven REGISTER) answered other than `forbidden`, or changing the instance it names; or a read answered with a chunk its tenant never stored (rows 30–33; see [`trust`]) |
//! | `l2_corrupt_served` | safety | a `retrieve` or `prepare_retrieve` answered with data after the simulated L2 answered its read `Corrupt` (row 28; the read's L1 slot was reserved, so no good copy was in L1) |
//! | `context_leaked` | liveness | an entry gone, its context neither freed nor waiting for a copy |
//! | `not_freed_at_shutdown` | liveness | a clean stop that left a context unfreed |
//! | `reap_late` | liveness | an entry still present more than R past its deadline (C5) |
//! | `spurious_stall` | liveness | a gap > stall threshold the server was not paused for: the loop slept past `poll_timeout`, hiding silence |
//! | `leak_at_end`, `not_converged` | liveness | end-of-run checks (see [`crate::world`]) |
//! | `core_diverged` | internal | the core answered other than the reference model |

mod judge;
mod trust;

pub use trust::{AttachExpect, TenantRead, Verdict, prefix_of, uid_tenant};

use crate::oracle::{CorrectedClock, EntryKey, GapKind, Shadow};
use crate::time::{Nanos, as_seconds};
use crate::violation::{Class, Violation};
use kvwarden_core::{FreeCause, InstanceId, Module, TransferError};
use std::collections::{BTreeMap, BTreeSet};

/// A hash set with a fixed seed: lookups only, never iterated.
type HashSet<T> = std::collections::HashSet<T, foldhash::fast::FixedState>;

/// Where a context is in its life.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ContextState {
    /// Handed to the core.
    Live,
    /// The core gave it back; its release waits for a copy in flight.
    Freeing,
    /// Released.
    Freed,
}

/// One context ever built.
#[derive(Copy, Clone, Debug)]
pub struct ContextRecord {
    /// Owner.
    pub instance: InstanceId,
    /// Module.
    pub module: Module,
    /// State.
    pub state: ContextState,
    /// Copies running against it.
    pub copies: u32,
}

/// What the server shell holds that must follow the registry (for the per-step checks).
pub struct ShellView<'a> {
    /// Instances with blend state (rope tables the shell was told to keep).
    pub blend: &'a BTreeSet<InstanceId>,
    /// L1 slots the node holds reserved or pinned.
    pub l1_held: usize,
    /// What explains them: reservations granted to live engine-driven contexts and not
    /// yet committed, plus copies running.
    pub l1_explained: usize,
}

/// An entry the node no longer holds: its key, the silence and proven flag its free
/// reported (a reap), and whether it was removed otherwise (a shutdown's unregistering).
pub type Gone = (EntryKey, Option<(Nanos, bool)>, bool);

/// The checker of one run.
#[derive(Debug)]
pub struct Checker {
    resolution: Nanos,
    clock: CorrectedClock,
    shadow: Shadow,
    /// Every context ever built, by id.
    pub contexts: Vec<ContextRecord>,
    live_per_key: BTreeMap<EntryKey, u32>,
    copies_per_key: BTreeMap<EntryKey, u32>,
    /// The context (ledger id) each entry was built with.
    entry_context: BTreeMap<EntryKey, u64>,
    ping_arrivals: BTreeMap<InstanceId, Nanos>,
    module_arrivals: BTreeMap<EntryKey, Nanos>,
    /// Per instance, the modules the worker registered in the instance's current life
    /// here (since it last held nothing) and was not told are gone.
    made: BTreeMap<InstanceId, BTreeSet<Module>>,
    /// Instances with a reap in the current step.
    reaped_now: Vec<InstanceId>,
    cleanly_gone: BTreeSet<InstanceId>,
    touched_keys: Vec<EntryKey>,
    touched_instances: Vec<InstanceId>,
    released_now: Vec<u64>,
    expected_stall: Option<Nanos>,
    /// The first violation.
    pub violation: Option<Violation>,
    now: Nanos,
    /// Keys whose published bytes reached L1 (a store's copy completed, a commit
    /// answered `true`), as the node keys them (the tenant's prefix, then the worker's
    /// key): the only keys L2 may be written (row 29), the only ones a read of the tenant
    /// may answer with data (row 33).
    published: HashSet<Vec<u8>>,
    /// The trust rules' reference model (rows 30–33).
    trust: trust::TrustModel,
    /// Requests (connection, request) whose L2 read was answered `Corrupt`: never
    /// answered with data (row 28).
    corrupt_reads: BTreeMap<(u64, u64), Vec<u8>>,
}

impl Checker {
    /// A checker for a server booted at `now` with these settings.
    pub fn new(
        now: Nanos,
        reap_timeout: Nanos,
        registration_grace: Nanos,
        resolution: Nanos,
        stall_threshold: Nanos,
    ) -> Checker {
        Checker {
            resolution,
            clock: CorrectedClock::new(now, stall_threshold),
            shadow: Shadow::new(reap_timeout, registration_grace),
            contexts: Vec::new(),
            live_per_key: BTreeMap::new(),
            copies_per_key: BTreeMap::new(),
            entry_context: BTreeMap::new(),
            ping_arrivals: BTreeMap::new(),
            module_arrivals: BTreeMap::new(),
            made: BTreeMap::new(),
            reaped_now: Vec::new(),
            cleanly_gone: BTreeSet::new(),
            touched_keys: Vec::new(),
            touched_instances: Vec::new(),
            released_now: Vec::new(),
            expected_stall: None,
            violation: None,
            now,
            published: HashSet::default(),
            corrupt_reads: BTreeMap::new(),
            trust: trust::TrustModel::default(),
        }
    }

    /// Records the first violation; later ones are consequences and are dropped.
    pub fn fail(&mut self, class: Class, invariant: &'static str, detail: String) {
        if self.violation.is_none() {
            self.violation = Some(Violation {
                class,
                invariant,
                at: self.now,
                detail,
            });
        }
    }

    /// The reference registry (read-only).
    pub fn shadow(&self) -> &Shadow {
        &self.shadow
    }

    /// Live contexts of `instance`, over modules.
    pub fn live_contexts(&self, instance: InstanceId) -> u32 {
        Module::ALL
            .iter()
            .map(|&m| self.live_per_key.get(&(instance, m)).copied().unwrap_or(0))
            .sum()
    }

    /// Live contexts of one key.
    pub fn live_contexts_of(&self, key: EntryKey) -> u32 {
        self.live_per_key.get(&key).copied().unwrap_or(0)
    }

    /// Live contexts in total.
    pub fn live_total(&self) -> u64 {
        self.live_per_key.values().map(|&n| u64::from(n)).sum()
    }

    // ----- L2 (rows 27–29) -----

    /// `key`'s published bytes are in L1 (a store's copy completed, or a commit was
    /// answered `true`).
    pub fn published(&mut self, key: Vec<u8>) {
        self.published.insert(key);
    }

    /// The node asked to write `key` to L2: only published data may go (row 29).
    /// Returns whether the bytes are the key's published ones.
    pub fn l2_write(&mut self, key: &[u8]) -> bool {
        if self.published.contains(key) {
            return true;
        }
        self.fail(
            Class::Safety,
            "l2_unpublished",
            format!(
                "the node wrote key {} to L2, but it was never published: no store's copy \
                 into L1 completed and no `commit_store` was answered `true` for it (row 29)",
                hex(key)
            ),
        );
        false
    }

    /// The simulated L2 answered `Corrupt` to the read a `retrieve` or
    /// `prepare_retrieve` caused.
    pub fn l2_corrupt_read(&mut self, request: (u64, u64), key: Vec<u8>) {
        self.corrupt_reads.insert(request, key);
    }

    /// A request was answered; `data`: with something other than nil or an error.
    pub fn answered(&mut self, request: (u64, u64), data: bool) {
        if self.corrupt_reads.is_empty() {
            return;
        }
        if let Some(key) = self.corrupt_reads.remove(&request)
            && data
        {
            self.fail(
                Class::Safety,
                "l2_corrupt_served",
                format!(
                    "a read of key {} was answered with data although L2 answered its value \
                     `Corrupt` and L1 held no copy (row 28: a corrupt value is a miss)",
                    hex(&key)
                ),
            );
        }
    }

    // ----- the server process -----

    /// The server process was paused (the next gap is a real stall).
    pub fn server_paused(&mut self, now: Nanos) {
        self.clock.paused(now);
    }

    /// The server process died: its contexts died with it (the OS reclaims them), and a
    /// new server starts from nothing at `now`.
    pub fn server_restarted(&mut self, now: Nanos) {
        self.now = now;
        for record in &mut self.contexts {
            record.state = ContextState::Freed;
        }
        self.live_per_key.clear();
        self.copies_per_key.clear();
        self.entry_context.clear();
        let threshold = self.clock.threshold();
        self.clock = CorrectedClock::new(now, threshold);
        self.shadow = Shadow::new(self.shadow.reap_timeout, self.shadow.registration_grace);
        self.ping_arrivals.clear();
        self.module_arrivals.clear();
        self.made.clear();
        self.reaped_now.clear();
        self.expected_stall = None;
        self.trust_restarted();
    }

    /// A request from `instance` reached the server's socket (evidence, whether or not
    /// the server has read it yet). `module` is None for a ping.
    pub fn arrived(&mut self, now: Nanos, instance: InstanceId, module: Option<Module>) {
        match module {
            None => {
                self.ping_arrivals.insert(instance, now);
            }
            Some(module) => {
                self.module_arrivals.insert((instance, module), now);
            }
        }
    }

    // ----- core calls, with the core's answers -----

    /// Every core call starts here: the corrected clock sees the input.
    fn input(&mut self, now: Nanos) -> Nanos {
        self.now = now;
        match self.clock.observe(now) {
            GapKind::None => {}
            GapKind::Stall(gap) => self.expected_stall = Some(gap),
            GapKind::Spurious(gap) => self.fail(
                Class::Liveness,
                "spurious_stall",
                format!(
                    "the core saw no input for {:.3}s although the server was never paused: \
                     the loop slept past poll_timeout, and the core credits the gap as a \
                     stall, hiding that much silence of every worker",
                    as_seconds(gap)
                ),
            ),
        }
        self.clock.now(now)
    }

    /// `handle_timeout(now)` was called.
    pub fn handle_timeout(&mut self, now: Nanos) {
        self.input(now);
    }

    /// `ping(now, Some(instance))` answered `tracked`.
    pub fn ping(&mut self, now: Nanos, instance: InstanceId, tracked: bool) {
        let now_c = self.input(now);
        let expected = self.shadow.touch(instance, now_c, true);
        if expected != tracked {
            self.diverged(format!(
                "ping({instance}) answered {tracked}, the reference model holds {expected}"
            ));
        }
        if !tracked {
            // The worker learns that it holds nothing here.
            self.made.remove(&instance);
            return;
        }
        let missing: Vec<Module> = self
            .made
            .get(&instance)
            .into_iter()
            .flatten()
            .copied()
            .filter(|&m| self.shadow.get((instance, m)).is_none())
            .collect();
        if let Some(module) = missing.first() {
            self.fail(
                Class::Safety,
                "ping_true_for_part",
                format!(
                    "ping({instance}) answered true although its {} registration is gone: \
                     the worker holds fewer registrations than it made and is not told",
                    module.label()
                ),
            );
        }
    }

    /// The worker no longer counts on `key` (it unregistered it, or was told it is gone).
    fn unmade(&mut self, key: EntryKey) {
        if let Some(modules) = self.made.get_mut(&key.0) {
            modules.remove(&key.1);
            if modules.is_empty() {
                self.made.remove(&key.0);
            }
        }
    }

    /// A request of the instance's owner (not a ping) was read: every entry of the
    /// instance is refreshed, building or not, without latching `proven`.
    pub fn evidence(&mut self, now: Nanos, instance: InstanceId) {
        let now_c = self.input(now);
        self.shadow.touch(instance, now_c, false);
    }

    /// `register` answered `Build` (with the server's build serial) or `Refreshed`.
    pub fn register(&mut self, now: Nanos, key: EntryKey, build: Option<u64>) {
        let now_c = self.input(now);
        let present = self.shadow.get(key).is_some();
        if !self.shadow.holds(key.0) {
            // A new life of the instance here: what an earlier life held is not what
            // this one promises (the worker's other REGISTERs may still be on the wire).
            self.made.remove(&key.0);
        }
        match build {
            Some(serial) => {
                if present {
                    self.diverged(format!(
                        "register{key:?} built although the entry is present"
                    ));
                }
                if self.cleanly_gone.contains(&key.0) {
                    self.fail(
                        Class::Safety,
                        "ghost_context",
                        format!(
                            "instance {} shut down cleanly (its UNREGISTER was processed), \
                             yet a REGISTER created a new entry in {}",
                            key.0,
                            key.1.label()
                        ),
                    );
                }
                self.shadow.insert(key, now_c, serial);
            }
            None => {
                if !present {
                    self.diverged(format!("register{key:?} refreshed an absent entry"));
                }
                self.shadow.touch(key.0, now_c, false);
            }
        }
        self.made.entry(key.0).or_default().insert(key.1);
    }

    /// Build `serial` gave the node a context (`BuildDone` with a context); it got id
    /// `context` in the ledger.
    pub fn built(&mut self, now: Nanos, key: EntryKey, serial: u64, context: u64) {
        let now_c = self.input(now);
        self.contexts.push(ContextRecord {
            instance: key.0,
            module: key.1,
            state: ContextState::Live,
            copies: 0,
        });
        debug_assert_eq!(self.contexts.len() as u64 - 1, context);
        *self.live_per_key.entry(key).or_default() += 1;
        self.touched_keys.push(key);
        if let Some(entry) = self.shadow.get(key)
            && entry.building == Some(serial)
        {
            self.shadow.built(key, now_c);
            self.entry_context.insert(key, context);
        }
        // Otherwise the core must hand the context straight back as Cancelled.
    }

    /// Build `serial` failed (`BuildDone` with an error).
    pub fn build_failed(&mut self, now: Nanos, key: EntryKey, serial: u64) {
        self.input(now);
        if self
            .shadow
            .get(key)
            .is_some_and(|e| e.building == Some(serial))
        {
            self.shadow.remove(key);
            self.touched_instances.push(key.0);
        }
        // The worker is answered with the failure.
        self.unmade(key);
    }

    /// `unregister` answered `was`; `clean_shutdown` when the worker is exiting.
    pub fn unregister(&mut self, now: Nanos, key: EntryKey, was: bool, clean_shutdown: bool) {
        self.input(now);
        let expected = self.shadow.remove(key).is_some();
        if expected != was {
            self.diverged(format!(
                "unregister{key:?} answered {was}, the reference model held {expected}"
            ));
        }
        if clean_shutdown {
            self.cleanly_gone.insert(key.0);
        }
        self.unmade(key);
        self.touched_instances.push(key.0);
    }

    /// `transfer` answered `result`; `context` is the id it used, when the node named it
    /// (a copy started).
    pub fn transfer(
        &mut self,
        now: Nanos,
        key: EntryKey,
        result: Result<Option<u64>, TransferError>,
    ) {
        let now_c = self.input(now);
        let expected = match self.shadow.get(key) {
            None => Err(TransferError::NotRegistered),
            Some(entry) if entry.building.is_some() => Err(TransferError::NotReady),
            Some(_) => Ok(()),
        };
        // Evidence for the whole instance, whatever the module.
        self.shadow.touch(key.0, now_c, false);
        if result == Err(TransferError::NotRegistered) {
            self.unmade(key);
        }
        if expected != result.map(|_| ()) {
            self.diverged(format!(
                "transfer{key:?} answered {result:?}, the reference model expected {expected:?}"
            ));
        }
        if let Ok(Some(context)) = result {
            let state = self.contexts.get(context as usize).map(|r| r.state);
            if state != Some(ContextState::Live) {
                self.fail(
                    Class::Safety,
                    "double_free",
                    format!("transfer{key:?} was handed context {context}, which is {state:?}"),
                );
            }
        }
    }

    /// `process_exited` answered `held`.
    pub fn process_exited(&mut self, now: Nanos, instance: InstanceId, held: bool) {
        self.input(now);
        let mut expected = false;
        for module in Module::ALL {
            expected |= self.shadow.remove((instance, module)).is_some();
        }
        if expected != held {
            self.diverged(format!(
                "process_exited({instance}) answered {held}, the reference model held {expected}"
            ));
        }
        self.made.remove(&instance);
        self.touched_instances.push(instance);
    }

    // ----- effects -----

    /// `Job::Free` for context `context` of `key` with `cause`: the node gave it back
    /// and asked for its free. Reaps are judged when they happen ([`Checker::reaped`]).
    pub fn free_requested(&mut self, key: EntryKey, context: u64, cause: FreeCause) {
        let copies = self.contexts.get(context as usize).map_or(0, |r| r.copies);
        if copies > 0 {
            self.fail(
                Class::Safety,
                "free_during_copy",
                format!(
                    "the node started the free of context {context} of {key:?} (cause {}) \
                     while {copies} copies still use it",
                    cause.label()
                ),
            );
            return;
        }
        let record = self.contexts.get_mut(context as usize);
        match record {
            Some(record) if record.state == ContextState::Live => {
                record.state = ContextState::Freeing;
                if let Some(n) = self.live_per_key.get_mut(&key) {
                    *n -= 1;
                    if *n == 0 {
                        self.live_per_key.remove(&key);
                    }
                }
            }
            other => {
                let state = other.map(|r| r.state);
                self.fail(
                    Class::Safety,
                    "double_free",
                    format!(
                        "the core freed context {context} of {key:?} (cause {}) but it is {state:?}",
                        cause.label()
                    ),
                );
                return;
            }
        }
        self.touched_instances.push(key.0);
    }

    /// The shell released context `context` (closed mappings, discarded reservations).
    pub fn released(&mut self, context: u64) {
        match self.contexts.get_mut(context as usize) {
            Some(record) if record.state == ContextState::Freeing => {
                record.state = ContextState::Freed;
                self.released_now.push(context);
            }
            other => {
                let state = other.map(|r| r.state);
                self.fail(
                    Class::Safety,
                    "double_free",
                    format!("context {context} released while {state:?}: freed more than once"),
                );
            }
        }
    }

    /// A copy started on context `context` (a transfer handed it out).
    pub fn copy_started(&mut self, context: u64) {
        if let Some(record) = self.contexts.get_mut(context as usize) {
            record.copies += 1;
            let key = (record.instance, record.module);
            *self.copies_per_key.entry(key).or_default() += 1;
        }
    }

    /// A copy on context `context` finished.
    pub fn copy_done(&mut self, context: u64) {
        if let Some(record) = self.contexts.get_mut(context as usize) {
            record.copies = record.copies.saturating_sub(1);
            let key = (record.instance, record.module);
            if let Some(n) = self.copies_per_key.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    self.copies_per_key.remove(&key);
                }
            }
            self.touched_instances.push(key.0);
        }
    }

    /// The registry's reap counter rose by `count` during one call, and `gone` lists
    /// the entries the reference model holds and the node no longer does: each is
    /// judged as a reap, unless it was removed otherwise (a shutdown's unregistering).
    /// The count of reaps must match.
    pub fn reaped(&mut self, count: u64, gone: Vec<Gone>) {
        let mut found = 0;
        for (key, reported, removed) in gone {
            self.touched_instances.push(key.0);
            if removed {
                self.shadow.remove(key);
                continue;
            }
            found += 1;
            self.judge_reap(key, reported);
        }
        if found != count {
            self.diverged(format!(
                "the core's reap counter rose by {count}, the reference model found {found} \
                 entries gone"
            ));
        }
    }

    /// Keys the reference model holds, in order.
    pub fn shadow_keys(&self) -> Vec<EntryKey> {
        self.shadow.keys().collect()
    }

    /// Entries the reference model holds.
    pub fn shadow_len(&self) -> usize {
        self.shadow.len()
    }

    /// An instance whose per-step invariants must be checked at the end of this step.
    pub fn touch_instance(&mut self, instance: InstanceId) {
        self.touched_instances.push(instance);
    }

    /// The node said the shutdown is complete: every context must have been freed,
    /// except one a copy still uses (the node gives up waiting for it and says so).
    pub fn stopped(&mut self) {
        if let Some((id, record)) = self
            .contexts
            .iter()
            .enumerate()
            .find(|(_, r)| r.state == ContextState::Live && r.copies == 0)
        {
            let detail = format!(
                "the server stopped cleanly but context {id} of instance {} ({}) was never \
                 freed",
                record.instance,
                record.module.label()
            );
            self.fail(Class::Liveness, "not_freed_at_shutdown", detail);
        }
    }

    /// `StallDetected { gap }`.
    pub fn stall_reported(&mut self, gap: Nanos) {
        if self.expected_stall.take() != Some(gap) {
            self.diverged(format!(
                "the core reported a stall of {:.6}s the reference clock did not credit",
                as_seconds(gap)
            ));
        }
    }
}

impl Checker {
    /// `now` on the reference corrected clock.
    pub fn corrected_now(&self, now: Nanos) -> Nanos {
        self.clock.now(now)
    }

    /// A past instant on the reference corrected clock.
    pub fn corrected_at(&self, instant: Nanos) -> Nanos {
        self.clock.at(instant)
    }
}

/// A key as hex, for violation details.
pub(crate) fn hex(key: &[u8]) -> String {
    key.iter().map(|byte| format!("{byte:02x}")).collect()
}
