//! The liveness registry (`kvwarden_core::liveness`; its names are re-exported at the
//! crate root): which worker instances hold state here, how long each has been silent,
//! and when each is due.
//!
//! Entries are keyed by `(instance, module)`. An entry is *building* from REGISTER until
//! the shell reports its context, then *ready*. It is *proven* once the instance has
//! pinged. Its window is the reap timeout when proven, the registration grace when not;
//! it is due when its silence strictly exceeds the window. Silence is measured on the
//! stall-corrected clock (see `core/src/stall.rs`), so a paused server reaps nobody.

use crate::config::{Config, ConfigError, REAP_TIMEOUT_FLOOR};
use crate::effect::{Effect, FreeCause};
use crate::expiry::{DueItem, ExpiryQueue, Serial};
use crate::id::InstanceId;
use crate::module::Module;
use crate::stall::StallClock;
use crate::time::{Instant, nanos_saturating};
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
    /// The last evidence of life, on the stall-corrected clock expressed as an instant
    /// of the shell's clock (stalls credited since then move it forward by their gap).
    pub last_seen: Instant,
    /// Whether the instance has pinged since this entry was created.
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
    pub tracked_instances: usize,
    /// Entries reaped since start.
    pub reaped_total: u64,
    /// Instances whose process exit was proven while they held entries.
    pub process_exits_total: u64,
    /// Stalls of the server detected since start.
    pub stalls_total: u64,
}

/// `(instance, module)` packed into one word: an instance id has 63 bits, the module
/// takes the last one. One `u64` hashes and compares faster than the pair, and every
/// `ping` probes twice (one probe per module).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
struct EntryKey(u64);

impl EntryKey {
    fn new(instance: InstanceId, module: Module) -> EntryKey {
        EntryKey(instance.get() << 1 | module.index() as u64)
    }
}

#[derive(Debug)]
struct Entry<C> {
    /// Stall-corrected nanoseconds.
    last_seen: u64,
    serial: Serial,
    proven: bool,
    /// None while building.
    context: Option<C>,
}

/// The liveness registry of a server. `C` is the shell's per-(instance, module)
/// context, opaque to the core; each one handed in comes back exactly once, through
/// [`Effect::FreeContext`].
pub struct Liveness<C> {
    config: Config,
    reap_timeout_nanos: u64,
    registration_grace_nanos: u64,
    clock: StallClock,
    entries: HashMap<EntryKey, Entry<C>, foldhash::fast::RandomState>,
    expiry: ExpiryQueue,
    effects: VecDeque<Effect<C>>,
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
        Ok(Liveness {
            reap_timeout_nanos: nanos_saturating(config.reap_timeout),
            registration_grace_nanos: nanos_saturating(config.registration_grace),
            clock: StallClock::new(now, config.stall_threshold),
            entries: HashMap::default(),
            expiry: ExpiryQueue::new(nanos_saturating(config.resolution)),
            effects: VecDeque::new(),
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

    /// PING [instance | None]. Refreshes `last_seen` and latches `proven` on every
    /// module's entry for the instance. Never inserts. Returns true when the instance
    /// is tracked in at least one module, or when `instance` is None (an untracked
    /// prober); false tells the worker it is not registered here.
    pub fn ping(&mut self, now: Instant, instance: Option<InstanceId>) -> bool {
        let now = self.observe(now);
        let Some(instance) = instance else {
            return true;
        };
        let mut tracked = false;
        for module in Module::ALL {
            if let Some(entry) = self.entries.get_mut(&EntryKey::new(instance, module)) {
                entry.last_seen = now;
                entry.proven = true;
                tracked = true;
            }
        }
        tracked
    }

    /// REGISTER, phase one. A present entry (in any state) is refreshed: `last_seen = now`,
    /// `proven` unchanged, nothing rebuilt → `Refreshed`. An absent one is inserted as
    /// building (`last_seen = now`, not proven) → `Build(ticket)`: the shell builds the
    /// context (opens IPC handles, maps memory) off its event loop and reports back.
    pub fn register(&mut self, now: Instant, instance: InstanceId, module: Module) -> Registration {
        let now = self.observe(now);
        if let Some(entry) = self.entries.get_mut(&EntryKey::new(instance, module)) {
            entry.last_seen = now;
            return Registration::Refreshed;
        }
        self.serials_issued += 1;
        let serial = Serial::new(self.serials_issued, module);
        let entry = Entry {
            last_seen: now,
            serial,
            proven: false,
            context: None,
        };
        self.entries.insert(EntryKey::new(instance, module), entry);
        if self.config.reaping_enabled() {
            // The shorter window first: should the entry prove itself before then, its
            // deadline is never earlier than this re-check.
            let recheck = now.saturating_add(self.reap_timeout_nanos);
            self.expiry.schedule(recheck, DueItem { instance, serial });
        }
        Registration::Build(BuildTicket { instance, serial })
    }

    /// REGISTER, phase two. Refreshes `last_seen`. If the entry was removed while it was
    /// building (unregister, reap, process exit), the context comes straight back as
    /// `Effect::FreeContext { cause: FreeCause::Cancelled, .. }`.
    pub fn context_built(&mut self, now: Instant, ticket: BuildTicket, context: C) {
        let now = self.observe(now);
        let module = ticket.module();
        match self
            .entries
            .get_mut(&EntryKey::new(ticket.instance, module))
        {
            Some(entry) if entry.serial == ticket.serial && entry.context.is_none() => {
                entry.last_seen = now;
                entry.context = Some(context);
            }
            _ => self.effects.push_back(Effect::FreeContext {
                instance: ticket.instance,
                module,
                context,
                cause: FreeCause::Cancelled,
            }),
        }
    }

    /// REGISTER failed in the shell: the building entry is removed; nothing to free.
    pub fn context_build_failed(&mut self, now: Instant, ticket: BuildTicket) {
        self.observe(now);
        let key = (ticket.instance, ticket.module());
        let building = self
            .entries
            .get(&EntryKey::new(key.0, key.1))
            .is_some_and(|entry| entry.serial == ticket.serial && entry.context.is_none());
        if building {
            self.remove(key, FreeCause::Cancelled);
        }
    }

    /// UNREGISTER. Returns false when absent. The context comes back as
    /// `FreeContext { cause: Unregistered }` (or is freed on arrival if still building).
    pub fn unregister(&mut self, now: Instant, instance: InstanceId, module: Module) -> bool {
        self.observe(now);
        self.remove((instance, module), FreeCause::Unregistered)
    }

    /// Any transfer (store, retrieve, prepare/commit). Refreshes `last_seen` without
    /// latching `proven`, so a worker whose heartbeat is starved is never reaped
    /// mid-transfer. Errors: `NotRegistered`, or `NotReady` while building (the
    /// attempt still counts as evidence of life).
    pub fn transfer(
        &mut self,
        now: Instant,
        instance: InstanceId,
        module: Module,
    ) -> Result<&C, TransferError> {
        let now = self.observe(now);
        let entry = self
            .entries
            .get_mut(&EntryKey::new(instance, module))
            .ok_or(TransferError::NotRegistered)?;
        entry.last_seen = now;
        entry.context.as_ref().ok_or(TransferError::NotReady)
    }

    /// The operating system proved that the instance's process exited (pidfd).
    /// Every entry of the instance is removed now, cause `ProcessExited`. Returns
    /// whether the instance held any entry.
    pub fn process_exited(&mut self, now: Instant, instance: InstanceId) -> bool {
        self.observe(now);
        let mut held = false;
        for module in Module::ALL {
            held |= self.remove((instance, module), FreeCause::ProcessExited);
        }
        if held {
            self.process_exits_total += 1;
        }
        held
    }

    /// Time passed. Reaps every entry whose deadline has passed. Spurious calls are harmless.
    pub fn handle_timeout(&mut self, now: Instant) {
        let now = self.observe(now);
        while let Some(items) = self.expiry.pop_due(now) {
            for item in items {
                self.recheck(now, item);
            }
        }
    }

    /// The instant at which `handle_timeout` must next be called. While reaping is
    /// enabled this is never later than the earliest reap deadline + `resolution`, and never
    /// later than `stall_threshold / 2` after the last input. It changes after every
    /// input.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        let stall_watch = self.clock.next_watch();
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
            tracked_instances: self.entries.len(),
            reaped_total: self.reaped_total,
            process_exits_total: self.process_exits_total,
            stalls_total: self.clock.stalls_total(),
        }
    }

    /// Read-only view of one entry, for status pages and tests.
    pub fn entry(&self, instance: InstanceId, module: Module) -> Option<EntryView> {
        let entry = self.entries.get(&EntryKey::new(instance, module))?;
        Some(EntryView {
            last_seen: self.clock.to_shell(entry.last_seen),
            proven: entry.proven,
            building: entry.context.is_none(),
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

    /// A due item fired: reap its entry if its silence exceeds its window, else
    /// schedule the next re-check.
    fn recheck(&mut self, now: u64, item: DueItem) {
        let key = (item.instance, item.serial.module());
        let Some(entry) = self.entries.get(&EntryKey::new(key.0, key.1)) else {
            return; // the entry went; the item is stale
        };
        if entry.serial != item.serial {
            return; // a later lifetime of the same key has its own item
        }
        let window = if entry.proven {
            self.reap_timeout_nanos
        } else {
            self.registration_grace_nanos
        };
        let silence = now.saturating_sub(entry.last_seen);
        if silence > window {
            let proven = entry.proven;
            self.reaped_total += 1;
            let cause = FreeCause::Reaped {
                silence: Duration::from_nanos(silence),
                proven,
            };
            self.remove(key, cause);
            return;
        }
        let deadline = entry.last_seen.saturating_add(window);
        // An unproven entry may prove itself at any moment, which shortens its window
        // to the reap timeout: never wait longer than that before looking again.
        let recheck = if entry.proven {
            deadline
        } else {
            deadline.min(now.saturating_add(self.reap_timeout_nanos))
        };
        self.expiry.schedule(recheck, item);
    }

    /// Removes the entry at `key`: its context (if built) goes out with `cause`, and
    /// when it was the instance's last entry the blend state goes after it.
    fn remove(&mut self, key: (InstanceId, Module), cause: FreeCause) -> bool {
        let Some(entry) = self.entries.remove(&EntryKey::new(key.0, key.1)) else {
            return false;
        };
        let (instance, module) = key;
        if let Some(context) = entry.context {
            self.effects.push_back(Effect::FreeContext {
                instance,
                module,
                context,
                cause,
            });
        }
        let last = Module::ALL
            .iter()
            .all(|&other| !self.entries.contains_key(&EntryKey::new(instance, other)));
        if last {
            self.effects.push_back(Effect::DropBlendState { instance });
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
