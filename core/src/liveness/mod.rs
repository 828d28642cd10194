//! The liveness registry (`kvwarden_core::liveness`; its names are re-exported at the
//! crate root): which worker instances hold state here, how long each has been silent,
//! and when each is due.
//!
//! An entry is one (instance, module) registration. It is *building* from REGISTER until
//! the shell reports its context, then *ready*. Liveness is judged per *instance*, not
//! per entry (failure-modes row 26: an instance is one process): every ping, register
//! and transfer of an instance refreshes the instance; it is *proven* once it has
//! pinged, for every entry it holds or registers later. Its window is the reap timeout
//! when proven, the registration grace when not; when its silence strictly exceeds the
//! window every entry of the instance is reaped in the same turn. Silence is measured
//! on the stall-corrected clock (see `stall.rs`), so a paused server reaps
//! nobody. The per-instance record lives in `record.rs`, the deadlines in
//! `expiry.rs`.

pub(crate) mod config;
pub(crate) mod effect;
mod expiry;
mod record;
mod stall;

use crate::id::InstanceId;
use crate::module::Module;
use crate::time::{Instant, nanos_saturating};
use config::{Config, ConfigError, REAP_TIMEOUT_FLOOR};
use effect::{Effect, FreeCause};
use expiry::{ExpiryWheel, Slot};
use record::{ModuleEntry, Recent, Record, Seen, Serial};
use stall::StallClock;
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

/// The outcome of REGISTER, phase one.
#[derive(Debug, PartialEq, Eq)]
pub enum Registration {
    /// The entry was present: liveness refreshed, nothing to build.
    Refreshed,
    /// A new building entry: build the context off the event loop, then report back.
    Build(BuildTicket),
}

/// Proof that a build was asked for; consumed by `context_built`/`context_build_failed`.
/// Not Clone, not Copy.
#[derive(Debug, PartialEq, Eq)]
pub struct BuildTicket {
    instance: InstanceId,
    serial: Serial,
}

impl BuildTicket {
    /// The instance the context is built for.
    pub fn instance(&self) -> InstanceId {
        self.instance
    }

    /// The module the context is built for.
    pub fn module(&self) -> Module {
        self.serial.module()
    }
}

/// Why a transfer was refused.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TransferError {
    /// No entry: the worker must re-register (as after a ping answered false).
    NotRegistered,
    /// The entry's context is still being built.
    NotReady,
}

/// A read-only view of one entry.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct EntryView {
    /// The instance's last evidence of life (every entry of an instance shares it), on
    /// the stall-corrected clock expressed as an instant of the shell's clock (stalls
    /// credited since then move it forward by their gap).
    pub last_seen: Instant,
    /// Whether the instance has pinged since it was registered (any of its entries).
    pub proven: bool,
    /// Whether the context is still being built.
    pub building: bool,
}

/// Counters and configuration, for status pages and metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    /// Whether reaping is enabled.
    pub enabled: bool,
    /// The reap timeout in force.
    pub reap_timeout: Duration,
    /// The registration grace in force.
    pub registration_grace: Duration,
    /// Entries summed over modules (building included).
    pub tracked_entries: usize,
    /// Entries reaped since start (an instance reaped whole counts each of its entries).
    pub reaped_total: u64,
    /// Instances whose process exit was proven while they held entries.
    pub process_exits_total: u64,
    /// Stalls of the server detected since start.
    pub stalls_total: u64,
}

/// The units of a turn's budget one re-check costs; a reap costs [`REAP_COST`].
const RECHECK_COST: u32 = 1;
/// A reap frees up to two contexts, emits effects and leaves the index: about ten to
/// twenty times a re-check.
const REAP_COST: u32 = 16;
/// What the index holds for a tracked instance.
#[derive(Copy, Clone, Debug)]
struct Tracked {
    slot: Slot,
    /// Last evidence and `proven`, exact.
    seen: Seen,
}

/// The reaper's coarse clock: units of `2^shift` ns, the largest power of two not
/// above the resolution, and the windows in those units (rounded down).
#[derive(Copy, Clone, Debug)]
struct CoarseUnits {
    shift: u32,
    timeout_units: u64,
    grace_units: u64,
    /// Ages a [`Recent`] word may have at a re-check beyond the gap since the last
    /// caught-up turn: both windows, a resolution, and slack.
    age_bound_units: u64,
}

impl CoarseUnits {
    fn new(config: &Config) -> Option<CoarseUnits> {
        let resolution = nanos_saturating(config.resolution).max(1);
        let shift = 63 - resolution.leading_zeros();
        let timeout_units = nanos_saturating(config.reap_timeout) >> shift;
        let grace_units = nanos_saturating(config.registration_grace) >> shift;
        let age_bound_units = timeout_units
            .saturating_add(grace_units)
            .saturating_add((resolution >> shift) + 4);
        (age_bound_units < Recent::UNITS).then_some(CoarseUnits {
            shift,
            timeout_units,
            grace_units,
            age_bound_units,
        })
    }
}

/// Items whose words one `handle_timeout` loads together (a batch may overrun the
/// budget by at most this many reaps).
const RECHECK_BATCH: usize = 64;
/// The default budget of one `handle_timeout`: about 0.3 ms of re-checks, or 1,000
/// reaps (targets.md C6: no single call over 1 ms).
pub const DEFAULT_TURN_BUDGET: u32 = 16_384;

/// The liveness registry of a server. `C` is the shell's per-(instance, module)
/// context, opaque to the core; each one handed in comes back exactly once, through
/// [`Effect::FreeContext`].
pub struct Liveness<C> {
    config: Config,
    reap_timeout_nanos: u64,
    registration_grace_nanos: u64,
    clock: StallClock,
    /// Instance → its slot and its exact liveness word: the one hash probe of a ping
    /// or a transfer, which writes the word where it found the slot.
    index: HashMap<InstanceId, Tracked, foldhash::fast::RandomState>,
    /// Per slot: the liveness word in coarse units (what a re-check reads first).
    recent: Vec<Recent>,
    /// The coarse units, when the windows fit in a [`Recent`] word.
    coarse: Option<CoarseUnits>,
    /// `now` in coarse units at the end of the last turn that left nothing due.
    caught_up_units: u64,
    /// Per slot: the contexts.
    records: Vec<Record<C>>,
    /// Slots free to hand out (their expiry item, if any, has fired).
    vacant: Vec<Slot>,
    expiry: ExpiryWheel,
    effects: VecDeque<Effect<C>>,
    entries_len: usize,
    turn_budget: u32,
    serials_issued: u64,
    reaped_total: u64,
    process_exits_total: u64,
}

impl<C> Liveness<C> {
    /// A registry with no entries whose clock starts at `now`; the configuration is
    /// checked with [`Config::validate`].
    pub fn new(config: Config, now: Instant) -> Result<Liveness<C>, ConfigError> {
        Self::new_with_floor(config, now, REAP_TIMEOUT_FLOOR)
    }

    /// As [`Liveness::new`], with another floor on a non-zero reap timeout (see
    /// [`Config::validate_with_floor`]). For tests and demos only.
    pub fn new_with_floor(
        config: Config,
        now: Instant,
        reap_timeout_floor: Duration,
    ) -> Result<Liveness<C>, ConfigError> {
        config.validate_with_floor(reap_timeout_floor)?;
        let reap_timeout_nanos = nanos_saturating(config.reap_timeout);
        Ok(Liveness {
            reap_timeout_nanos,
            registration_grace_nanos: nanos_saturating(config.registration_grace),
            clock: StallClock::new(now, config.stall_threshold),
            index: HashMap::default(),
            recent: Vec::new(),
            coarse: CoarseUnits::new(&config),
            caught_up_units: 0,
            records: Vec::new(),
            vacant: Vec::new(),
            expiry: ExpiryWheel::new(nanos_saturating(config.resolution), reap_timeout_nanos),
            effects: VecDeque::new(),
            entries_len: 0,
            turn_budget: DEFAULT_TURN_BUDGET,
            serials_issued: 0,
            reaped_total: 0,
            process_exits_total: 0,
            config,
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Caps the expiry work of one `handle_timeout` (a re-check costs 1, a reap 16;
    /// at least 1). Work left over continues at the next call, which `poll_timeout`
    /// asks for at once. For tests that split every bucket, and for benchmarks.
    #[doc(hidden)]
    pub fn set_turn_budget(&mut self, units: u32) {
        self.turn_budget = units.max(1);
    }

    /// PING [instance | None]. Refreshes the instance's `last_seen` and latches its
    /// `proven` (for every module it holds or registers later). Never inserts. Returns
    /// true when the instance is tracked in at least one module, or when `instance` is
    /// None (an untracked prober); false tells the worker it is not registered here.
    /// Since an instance lives and dies whole, true means every registration the worker
    /// made and did not unregister is held.
    pub fn ping(&mut self, now: Instant, instance: Option<InstanceId>) -> bool {
        let now = self.observe(now);
        let Some(instance) = instance else {
            return true;
        };
        let shift = self.shift();
        match self.index.get_mut(&instance) {
            Some(tracked) => {
                tracked.seen = Seen::new(now, true);
                self.recent[tracked.slot as usize] = Recent::new(now >> shift, true);
                true
            }
            None => false,
        }
    }

    /// REGISTER, phase one. Refreshes the instance (`last_seen = now`, `proven`
    /// unchanged). A present entry (in any state) is left as it is → `Refreshed`. An
    /// absent one is inserted as building → `Build(ticket)`: the shell builds the
    /// context (opens IPC handles, maps memory) off its event loop and reports back.
    /// An instance new here starts unproven.
    pub fn register(&mut self, now: Instant, instance: InstanceId, module: Module) -> Registration {
        let now = self.observe(now);
        let slot = match self.refresh(instance, now) {
            Some(slot) => slot,
            None => self.admit(now, instance),
        };
        let entry = &mut self.records[slot as usize].modules[module.index()];
        if entry.is_present() {
            return Registration::Refreshed;
        }
        self.serials_issued += 1;
        let serial = Serial::new(self.serials_issued, module);
        *entry = ModuleEntry::Building(serial);
        self.entries_len += 1;
        Registration::Build(BuildTicket { instance, serial })
    }

    /// REGISTER, phase two. Refreshes the instance. If the entry was removed while it
    /// was building (unregister, reap, process exit), the context comes straight back
    /// as `Effect::FreeContext { cause: FreeCause::Cancelled, .. }`.
    pub fn context_built(&mut self, now: Instant, ticket: BuildTicket, context: C) {
        let now = self.observe(now);
        let module = ticket.module();
        if let Some(slot) = self.building_slot(&ticket) {
            self.records[slot as usize].modules[module.index()] = ModuleEntry::Ready(context);
            self.refresh(ticket.instance, now);
            return;
        }
        self.effects.push_back(Effect::FreeContext {
            instance: ticket.instance,
            module,
            context,
            cause: FreeCause::Cancelled,
        });
    }

    /// REGISTER failed in the shell: the building entry is removed; nothing to free.
    pub fn context_build_failed(&mut self, now: Instant, ticket: BuildTicket) {
        self.observe(now);
        if let Some(slot) = self.building_slot(&ticket) {
            self.remove_entry(slot, ticket.module(), FreeCause::Cancelled);
        }
    }

    /// UNREGISTER. Returns false when absent. Frees that module's entry alone: the
    /// context comes back as `FreeContext { cause: Unregistered }` (or is freed on
    /// arrival if still building).
    pub fn unregister(&mut self, now: Instant, instance: InstanceId, module: Module) -> bool {
        self.observe(now);
        let Some(slot) = self.index.get(&instance).map(|t| t.slot) else {
            return false;
        };
        self.remove_entry(slot, module, FreeCause::Unregistered)
    }

    /// Any transfer (store, retrieve, prepare/commit). Refreshes the instance's
    /// `last_seen` without latching `proven`, so a worker whose heartbeat is starved is
    /// never reaped mid-transfer. Errors: `NotRegistered` (the module holds no entry of
    /// the instance), or `NotReady` while building; a tracked instance is refreshed
    /// either way (the attempt is evidence that the process lives).
    pub fn transfer(
        &mut self,
        now: Instant,
        instance: InstanceId,
        module: Module,
    ) -> Result<&C, TransferError> {
        let now = self.observe(now);
        let slot = self
            .refresh(instance, now)
            .ok_or(TransferError::NotRegistered)?;
        match &self.records[slot as usize].modules[module.index()] {
            ModuleEntry::Ready(context) => Ok(context),
            ModuleEntry::Building(_) => Err(TransferError::NotReady),
            ModuleEntry::Absent => Err(TransferError::NotRegistered),
        }
    }

    /// The operating system proved that the instance's process exited (pidfd).
    /// Every entry of the instance is removed now, cause `ProcessExited`. Returns
    /// whether the instance held any entry.
    pub fn process_exited(&mut self, now: Instant, instance: InstanceId) -> bool {
        self.observe(now);
        let Some(slot) = self.index.get(&instance).map(|t| t.slot) else {
            return false;
        };
        for module in Module::ALL {
            self.remove_entry(slot, module, FreeCause::ProcessExited);
        }
        self.process_exits_total += 1;
        true
    }

    /// Time passed. Reaps every instance whose silence exceeds its window, all of its
    /// entries in the same call. The work of one call is bounded: what is left over
    /// continues at the next call, which [`Liveness::poll_timeout`] then asks for at
    /// once. Spurious calls are harmless.
    pub fn handle_timeout(&mut self, now: Instant) {
        let now = self.observe(now);
        let now_units = now >> self.shift();
        // The fast path needs every word's true age below what a word tells apart.
        let fast = self.coarse.is_some_and(|coarse| {
            now_units
                .saturating_sub(self.caught_up_units)
                .saturating_add(coarse.age_bound_units)
                < Recent::UNITS
        });
        let mut budget = self.turn_budget;
        let mut slots = [0 as Slot; RECHECK_BATCH];
        let mut words = [Recent::VACANT; RECHECK_BATCH];
        while budget > 0 {
            // Take a batch of items first, then load their words in one tight loop: the
            // loads are independent, so their cache misses overlap instead of queueing
            // behind each item's bookkeeping. A slot has one item, so no word of a batch
            // changes while the batch is judged.
            let wanted = (budget as usize).min(RECHECK_BATCH);
            let taken = self.expiry.pop_batch(now, &mut slots[..wanted]);
            for (word, &slot) in words.iter_mut().zip(&slots[..taken]) {
                *word = self.recent[slot as usize];
            }
            for (&slot, &word) in slots[..taken].iter().zip(&words[..taken]) {
                let spent = match word {
                    word if word.is_vacant() => {
                        self.vacant.push(slot);
                        RECHECK_COST
                    }
                    word if fast && self.recheck_recent(now, now_units, slot, word) => RECHECK_COST,
                    _ => self.recheck(now, slot),
                };
                budget = budget.saturating_sub(spent);
            }
            if taken < wanted {
                break;
            }
        }
        self.expiry.settle();
        if !self.expiry.pending() && self.expiry.next_fire().is_none_or(|fire| fire > now) {
            self.caught_up_units = now_units;
        }
    }

    /// The instant at which `handle_timeout` must next be called. While reaping is
    /// enabled this is never later than the earliest reap deadline + `resolution`, and never
    /// later than `stall_threshold / 2` after the last input; while a fired bucket is
    /// not yet worked off it is the last input's instant (at once). It changes after
    /// every input.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        let stall_watch = self.clock.next_watch();
        if self.expiry.pending() {
            return Some(self.clock.last_input().min(stall_watch));
        }
        let reap = self.expiry.next_fire().map(|at| self.clock.to_shell(at));
        Some(reap.map_or(stall_watch, |reap| reap.min(stall_watch)))
    }

    /// Drains the effects queued by the calls above, oldest first.
    #[must_use]
    pub fn poll_effect(&mut self) -> Option<Effect<C>> {
        self.effects.pop_front()
    }

    /// Counters and configuration.
    pub fn status(&self) -> Status {
        Status {
            enabled: self.config.reaping_enabled(),
            reap_timeout: self.config.reap_timeout,
            registration_grace: self.config.registration_grace,
            tracked_entries: self.entries_len,
            reaped_total: self.reaped_total,
            process_exits_total: self.process_exits_total,
            stalls_total: self.clock.stalls_total(),
        }
    }

    /// Read-only view of one entry, for status pages and tests; `last_seen` and
    /// `proven` are the instance's.
    pub fn entry(&self, instance: InstanceId, module: Module) -> Option<EntryView> {
        let tracked = self.index.get(&instance)?;
        let building = match &self.records[tracked.slot as usize].modules[module.index()] {
            ModuleEntry::Absent => return None,
            ModuleEntry::Building(_) => true,
            ModuleEntry::Ready(_) => false,
        };
        let seen = tracked.seen;
        Some(EntryView {
            last_seen: self.clock.to_shell(seen.last_seen()),
            proven: seen.proven(),
            building,
        })
    }

    /// Feeds `now` to the stall guard; returns it on the stall-corrected clock.
    fn observe(&mut self, now: Instant) -> u64 {
        let (now, stall) = self.clock.observe(now);
        if let Some(gap) = stall {
            self.effects.push_back(Effect::StallDetected { gap });
        }
        now
    }

    /// A slot for an instance new here, unproven, with its first expiry item.
    fn admit(&mut self, now: u64, instance: InstanceId) -> Slot {
        let recent = Recent::new(now >> self.shift(), false);
        let slot = match self.vacant.pop() {
            Some(slot) => {
                self.recent[slot as usize] = recent;
                self.records[slot as usize] = Record::new(instance);
                slot
            }
            None => {
                // 2^32 instances would need hundreds of GiB of records first.
                let slot = Slot::try_from(self.records.len()).unwrap_or(Slot::MAX);
                self.recent.push(recent);
                self.records.push(Record::new(instance));
                slot
            }
        };
        let seen = Seen::new(now, false);
        self.index.insert(instance, Tracked { slot, seen });
        if self.config.reaping_enabled() {
            // The shorter window first: should the instance prove itself before then,
            // its deadline is never earlier than this re-check.
            self.expiry
                .schedule(now.saturating_add(self.reap_timeout_nanos), slot);
        }
        slot
    }

    /// The slot of the ticket's entry if it is still the same building entry.
    fn building_slot(&self, ticket: &BuildTicket) -> Option<Slot> {
        let slot = self.index.get(&ticket.instance)?.slot;
        match self.records[slot as usize].modules[ticket.module().index()] {
            ModuleEntry::Building(serial) if serial == ticket.serial => Some(slot),
            _ => None,
        }
    }

    /// The coarse units' shift (0 when the fast path is off: the words are unused).
    fn shift(&self) -> u32 {
        self.coarse.map_or(0, |coarse| coarse.shift)
    }

    /// Evidence of life for `instance` at `now` (not a ping); its slot, when tracked.
    fn refresh(&mut self, instance: InstanceId, now: u64) -> Option<Slot> {
        let shift = self.shift();
        let tracked = self.index.get_mut(&instance)?;
        tracked.seen = tracked.seen.refreshed(now, false);
        self.recent[tracked.slot as usize] = Recent::new(now >> shift, tracked.seen.proven());
        Some(tracked.slot)
    }

    /// The fast path of a re-check, from the coarse word alone: when the instance is
    /// surely not due (its silence is below a whole number of units that fits in its
    /// window), file it again at a lower bound of its deadline (never later than the
    /// true one) and return true. Otherwise false: the exact word decides.
    fn recheck_recent(&mut self, now: u64, now_units: u64, slot: Slot, word: Recent) -> bool {
        let Some(coarse) = self.coarse else {
            return false;
        };
        let proven = word.proven();
        let window_units = if proven {
            coarse.timeout_units
        } else {
            coarse.grace_units
        };
        let age = word.age(now_units);
        // Silence < (age + 1) units <= the window.
        if age + 1 > window_units {
            return false;
        }
        let last_seen_at_least = (now_units - age) << coarse.shift;
        let recheck = self.recheck_at(now, last_seen_at_least, proven);
        self.expiry.schedule(recheck, slot);
        true
    }

    /// A slot's expiry item fired and the coarse word could not clear it: reap the
    /// instance whole if its exact silence exceeds its window, else file the slot for its
    /// next re-check. Returns the budget units spent.
    fn recheck(&mut self, now: u64, slot: Slot) -> u32 {
        let instance = self.records[slot as usize].instance;
        let Some(seen) = self.index.get(&instance).map(|t| t.seen) else {
            // Unreachable: a slot whose instance left the index is marked vacant.
            self.recent[slot as usize] = Recent::VACANT;
            self.vacant.push(slot);
            return RECHECK_COST;
        };
        let proven = seen.proven();
        let silence = now.saturating_sub(seen.last_seen());
        if silence > self.window(proven) {
            let cause = FreeCause::Reaped {
                silence: Duration::from_nanos(silence),
                proven,
            };
            for module in Module::ALL {
                if self.remove_entry(slot, module, cause) {
                    self.reaped_total += 1;
                }
            }
            // This item was the slot's last: it is free now.
            self.recent[slot as usize] = Recent::VACANT;
            self.vacant.push(slot);
            return REAP_COST;
        }
        let recheck = self.recheck_at(now, seen.last_seen(), proven);
        self.expiry.schedule(recheck, slot);
        RECHECK_COST
    }

    /// The reap window: the silence after which an instance is reaped, the reap timeout
    /// once it has proven itself, the registration grace before. The one place the rule
    /// is written; `recheck` and the coarse fast path both read it.
    fn window(&self, proven: bool) -> u64 {
        if proven {
            self.reap_timeout_nanos
        } else {
            self.registration_grace_nanos
        }
    }

    /// When to look again at an instance last seen at `last_seen` (or later) that is not
    /// due yet: at its deadline; for an unproven one no later than a reap timeout from
    /// `now`, since it may prove itself at any moment, which shortens its window.
    fn recheck_at(&self, now: u64, last_seen: u64, proven: bool) -> u64 {
        let deadline = last_seen.saturating_add(self.window(proven));
        if proven {
            deadline
        } else {
            deadline.min(now.saturating_add(self.reap_timeout_nanos))
        }
    }

    /// Removes the instance's entry in `module`: its context (if built) goes out with
    /// `cause`; when it was the instance's last entry the blend state goes after it and
    /// the instance leaves the index (its slot is vacated). Returns whether there was
    /// an entry.
    fn remove_entry(&mut self, slot: Slot, module: Module, cause: FreeCause) -> bool {
        let record = &mut self.records[slot as usize];
        let instance = record.instance;
        match std::mem::replace(&mut record.modules[module.index()], ModuleEntry::Absent) {
            ModuleEntry::Absent => return false,
            ModuleEntry::Building(_) => {}
            ModuleEntry::Ready(context) => self.effects.push_back(Effect::FreeContext {
                instance,
                module,
                context,
                cause,
            }),
        }
        self.entries_len -= 1;
        if record.present() == 0 {
            self.effects.push_back(Effect::DropBlendState { instance });
            self.index.remove(&instance);
            if self.config.reaping_enabled() {
                // Its expiry item is still queued: the slot is handed out once it fires.
                self.recent[slot as usize] = Recent::VACANT;
            } else {
                self.vacant.push(slot);
            }
        }
        true
    }

    /// Expiry items scheduled, stale ones included (for benchmarks and tests).
    #[doc(hidden)]
    pub fn scheduled_len(&self) -> usize {
        self.expiry.len()
    }
}

impl<C> std::fmt::Debug for Liveness<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Liveness")
            .field("config", &self.config)
            .field("status", &self.status())
            .finish_non_exhaustive()
    }
}
