//! Model-based test: the registry against a deliberately naive reference (a `BTreeMap`
//! of instances, each with its entries, and a full scan on every tick), driven by
//! random sequences of every input with random time steps — small, stalls, and
//! backwards. After every step the outcomes, the entries, the counters and the effects
//! (as a multiset per step) must agree.
//!
//! Liveness is per instance (failure-modes row 26): every ping, register and transfer
//! refreshes the instance, `proven` is the instance's, and a reap takes every entry of
//! the instance in the same call. A reap may come at any tick from the first instant
//! the instance is due until `resolution` after its deadline, and must come by then,
//! unless the core says its turn's budget ran out, in which case it must ask to be
//! woken at once. The budget is drawn per case, down to one unit per call, so that
//! every bucket is split.

use kvwarden_core::{
    BuildTicket, Config, Effect, FreeCause, InstanceId, Instant, Liveness, Module, Registration,
    TransferError,
};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet, btree_map};
use std::time::Duration;

const IDS: u8 = 4;

#[derive(Clone, Debug)]
enum Op {
    /// Move the shell clock by this many nanoseconds (negative: a clock that went back).
    Step(i64),
    Ping(Option<u8>),
    Register(u8, Module),
    Built(usize),
    BuildFailed(usize),
    Unregister(u8, Module),
    Transfer(u8, Module),
    ProcessExited(u8),
    /// `handle_timeout(now)`.
    Tick,
    /// Jump to `poll_timeout()` and handle it, as a shell's loop would.
    TickAtWake,
    /// Jump to an instance's deadline plus an offset in nanoseconds, and handle it.
    TickAtDeadline(u8, i64),
}

fn module() -> impl Strategy<Value = Module> {
    prop_oneof![Just(Module::ServerDriven), Just(Module::EngineDriven)]
}

fn op() -> impl Strategy<Value = Op> {
    let ms = 1_000_000i64;
    prop_oneof![
        6 => (0..1_500 * ms).prop_map(Op::Step),
        1 => (3_000 * ms..400_000 * ms).prop_map(Op::Step),
        1 => (-5_000 * ms..0).prop_map(Op::Step),
        4 => proptest::option::weighted(0.9, 0..IDS).prop_map(Op::Ping),
        4 => (0..IDS, module()).prop_map(|(i, m)| Op::Register(i, m)),
        3 => any::<usize>().prop_map(Op::Built),
        1 => any::<usize>().prop_map(Op::BuildFailed),
        2 => (0..IDS, module()).prop_map(|(i, m)| Op::Unregister(i, m)),
        3 => (0..IDS, module()).prop_map(|(i, m)| Op::Transfer(i, m)),
        1 => (0..IDS).prop_map(Op::ProcessExited),
        3 => Just(Op::Tick),
        6 => Just(Op::TickAtWake),
        3 => (0..IDS, prop_oneof![Just(-1i64), Just(0), Just(1), Just(250 * ms), Just(500 * ms), Just(500 * ms + 1)])
            .prop_map(|(i, offset)| Op::TickAtDeadline(i, offset)),
    ]
}

fn config() -> impl Strategy<Value = Config> {
    let ms = Duration::from_millis;
    prop_oneof![
        Just(Config {
            reap_timeout: ms(4000),
            registration_grace: ms(8000),
            resolution: ms(500),
            stall_threshold: ms(3000)
        }),
        Just(Config {
            reap_timeout: ms(4000),
            registration_grace: ms(4000),
            resolution: ms(250),
            stall_threshold: ms(10_000)
        }),
        // Coarse units of ~1 ms: a word tells ages apart over ~17 s only, so long gaps
        // between turns switch the reaper's fast path off.
        Just(Config {
            reap_timeout: ms(4000),
            registration_grace: ms(8000),
            resolution: ms(2),
            stall_threshold: ms(3000)
        }),
        Just(Config {
            reap_timeout: ms(30_000),
            registration_grace: ms(60_000),
            resolution: ms(1000),
            stall_threshold: ms(5000)
        }),
        Just(Config {
            reap_timeout: Duration::ZERO,
            registration_grace: Duration::ZERO,
            resolution: ms(1000),
            stall_threshold: ms(3000)
        }),
    ]
}

fn instance(i: u8) -> InstanceId {
    InstanceId::new(1000 + u64::from(i)).unwrap()
}

#[derive(Clone, Debug)]
struct ModelEntry {
    serial: u64,
    context: Option<u32>,
}

#[derive(Clone, Debug)]
struct ModelInstance {
    last_seen: u64,
    proven: bool,
    entries: BTreeMap<Module, ModelEntry>,
}

/// The naive reference: every instance in a sorted map, every tick scans them all.
struct Model {
    config: Config,
    last_input: u64,
    credited: u64,
    instances: BTreeMap<u8, ModelInstance>,
    serials: u64,
    reaped_total: u64,
    process_exits_total: u64,
    stalls_total: u64,
}

impl Model {
    fn nanos(span: Duration) -> u64 {
        span.as_nanos() as u64
    }

    fn observe(&mut self, now: u64, expected: &mut Vec<Effect<u32>>) -> u64 {
        let now = now.max(self.last_input);
        let gap = now - self.last_input;
        if gap > Self::nanos(self.config.stall_threshold) {
            self.credited += gap;
            self.stalls_total += 1;
            expected.push(Effect::StallDetected {
                gap: Duration::from_nanos(gap),
            });
        }
        self.last_input = now;
        now - self.credited
    }

    fn window(&self, instance: &ModelInstance) -> u64 {
        Self::nanos(if instance.proven {
            self.config.reap_timeout
        } else {
            self.config.registration_grace
        })
    }

    fn entry(&self, key: (u8, Module)) -> Option<&ModelEntry> {
        self.instances.get(&key.0)?.entries.get(&key.1)
    }

    fn entries_len(&self) -> usize {
        self.instances.values().map(|i| i.entries.len()).sum()
    }

    fn remove(
        &mut self,
        key: (u8, Module),
        cause: FreeCause,
        expected: &mut Vec<Effect<u32>>,
    ) -> bool {
        let Some(record) = self.instances.get_mut(&key.0) else {
            return false;
        };
        let Some(entry) = record.entries.remove(&key.1) else {
            return false;
        };
        if let Some(context) = entry.context {
            expected.push(Effect::FreeContext {
                instance: instance(key.0),
                module: key.1,
                context,
                cause,
            });
        }
        if record.entries.is_empty() {
            self.instances.remove(&key.0);
            expected.push(Effect::DropBlendState {
                instance: instance(key.0),
            });
        }
        true
    }
}

fn sorted(effects: &[Effect<u32>]) -> Vec<String> {
    let mut list: Vec<String> = effects.iter().map(|e| format!("{e:?}")).collect();
    list.sort();
    list
}

fn run(config: Config, budget: Option<u32>, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let start = 1_000_000_000u64;
    let mut liveness: Liveness<u32> =
        Liveness::new_with_floor(config.clone(), Instant::from_nanos(start), Duration::ZERO)
            .unwrap();
    if let Some(units) = budget {
        liveness.set_turn_budget(units);
    }
    let mut model = Model {
        config: config.clone(),
        last_input: start,
        credited: 0,
        instances: BTreeMap::new(),
        serials: 0,
        reaped_total: 0,
        process_exits_total: 0,
        stalls_total: 0,
    };
    let resolution = Model::nanos(config.resolution);
    let mut now = start;
    let mut pending: Vec<(BuildTicket, u64)> = Vec::new();
    let mut next_context = 1u32;
    let mut handed: BTreeSet<u32> = BTreeSet::new();
    let mut freed: BTreeSet<u32> = BTreeSet::new();

    for op in ops.into_iter().chain([Op::Step(0)]) {
        let mut expected = Vec::new();
        let mut is_tick = false;
        match op {
            Op::Step(delta) => {
                now = now.saturating_add_signed(delta).max(1);
                continue;
            }
            Op::Ping(who) => {
                let answer = liveness.ping(Instant::from_nanos(now), who.map(instance));
                let t = model.observe(now, &mut expected);
                let mut tracked = who.is_none();
                if let Some(record) = who.and_then(|i| model.instances.get_mut(&i)) {
                    record.last_seen = t;
                    record.proven = true;
                    tracked = true;
                }
                prop_assert_eq!(answer, tracked, "ping {:?}", who);
            }
            Op::Register(i, m) => {
                let outcome = liveness.register(Instant::from_nanos(now), instance(i), m);
                let t = model.observe(now, &mut expected);
                let record = model.instances.entry(i).or_insert(ModelInstance {
                    last_seen: t,
                    proven: false,
                    entries: BTreeMap::new(),
                });
                record.last_seen = t;
                if let btree_map::Entry::Vacant(vacant) = record.entries.entry(m) {
                    model.serials += 1;
                    vacant.insert(ModelEntry {
                        serial: model.serials,
                        context: None,
                    });
                    let Registration::Build(ticket) = outcome else {
                        return Err(TestCaseError::fail("absent entry was not built"));
                    };
                    prop_assert_eq!((ticket.instance(), ticket.module()), (instance(i), m));
                    pending.push((ticket, model.serials));
                } else {
                    prop_assert_eq!(outcome, Registration::Refreshed);
                }
            }
            Op::Built(pick) | Op::BuildFailed(pick) if !pending.is_empty() => {
                let (ticket, serial) = pending.remove(pick % pending.len());
                let (i, m) = ((ticket.instance().get() - 1000) as u8, ticket.module());
                let t = model.observe(now, &mut expected);
                let current = model
                    .entry((i, m))
                    .is_some_and(|e| e.serial == serial && e.context.is_none());
                if matches!(op, Op::Built(_)) {
                    let context = next_context;
                    next_context += 1;
                    handed.insert(context);
                    liveness.context_built(Instant::from_nanos(now), ticket, context);
                    if current {
                        let record = model.instances.get_mut(&i).unwrap();
                        record.entries.get_mut(&m).unwrap().context = Some(context);
                        record.last_seen = t;
                    } else {
                        expected.push(Effect::FreeContext {
                            instance: instance(i),
                            module: m,
                            context,
                            cause: FreeCause::Cancelled,
                        });
                    }
                } else {
                    liveness.context_build_failed(Instant::from_nanos(now), ticket);
                    if current {
                        model.remove((i, m), FreeCause::Cancelled, &mut expected);
                    }
                }
            }
            Op::Built(_) | Op::BuildFailed(_) => continue,
            Op::Unregister(i, m) => {
                let answer = liveness.unregister(Instant::from_nanos(now), instance(i), m);
                model.observe(now, &mut expected);
                let was = model.remove((i, m), FreeCause::Unregistered, &mut expected);
                prop_assert_eq!(answer, was);
            }
            Op::Transfer(i, m) => {
                let answer = liveness
                    .transfer(Instant::from_nanos(now), instance(i), m)
                    .copied();
                let t = model.observe(now, &mut expected);
                let wanted = match model.instances.get_mut(&i) {
                    None => Err(TransferError::NotRegistered),
                    Some(record) => {
                        // Evidence that the process lives, whatever the module.
                        record.last_seen = t;
                        match record.entries.get(&m) {
                            None => Err(TransferError::NotRegistered),
                            Some(entry) => entry.context.ok_or(TransferError::NotReady),
                        }
                    }
                };
                prop_assert_eq!(answer, wanted);
            }
            Op::ProcessExited(i) => {
                let answer = liveness.process_exited(Instant::from_nanos(now), instance(i));
                model.observe(now, &mut expected);
                let mut held = false;
                for m in Module::ALL {
                    held |= model.remove((i, m), FreeCause::ProcessExited, &mut expected);
                }
                if held {
                    model.process_exits_total += 1;
                }
                prop_assert_eq!(answer, held);
            }
            Op::Tick | Op::TickAtWake | Op::TickAtDeadline(..) => {
                match op {
                    Op::TickAtWake => now = liveness.poll_timeout().unwrap().as_nanos().max(now),
                    Op::TickAtDeadline(i, offset) => {
                        if let Some(record) = model.instances.get(&i) {
                            let deadline = record.last_seen + model.window(record) + model.credited;
                            now = deadline.saturating_add_signed(offset).max(now);
                        }
                    }
                    _ => {}
                }
                is_tick = true;
                liveness.handle_timeout(Instant::from_nanos(now));
                let t = model.observe(now, &mut expected);
                // Unless the core asks to be woken at once (at the latest input, its
                // `now`), its turn is done: nothing due may be left.
                let turn_done = liveness.poll_timeout().unwrap().as_nanos() > model.last_input;

                if model.config.reaping_enabled() {
                    let mut reaped = Vec::new();
                    for (&i, record) in &model.instances {
                        let silence = t - record.last_seen;
                        let window = model.window(record);
                        let held: Vec<bool> = record
                            .entries
                            .keys()
                            .map(|&m| liveness.entry(instance(i), m).is_some())
                            .collect();
                        let gone = !held.iter().any(|&h| h);
                        prop_assert!(
                            gone || held.iter().all(|&h| h),
                            "instance {} reaped in part: {:?}",
                            i,
                            held
                        );
                        prop_assert!(
                            !gone || silence > window,
                            "instance {} reaped early: silence {} <= window {}",
                            i,
                            silence,
                            window
                        );
                        prop_assert!(
                            gone || !turn_done || silence < window + resolution,
                            "instance {} not reaped: silence {} >= window {} + resolution",
                            i,
                            silence,
                            window
                        );
                        if gone {
                            reaped.push((i, silence, record.proven));
                        }
                    }
                    for (i, silence, proven) in reaped {
                        let cause = FreeCause::Reaped {
                            silence: Duration::from_nanos(silence),
                            proven,
                        };
                        for m in Module::ALL {
                            if model.remove((i, m), cause, &mut expected) {
                                model.reaped_total += 1;
                            }
                        }
                    }
                }
            }
        }

        // Effects: the same multiset. Cancelled frees and reaps may interleave freely.
        let mut actual = Vec::new();
        while let Some(effect) = liveness.poll_effect() {
            if let Effect::FreeContext { context, .. } = &effect {
                prop_assert!(freed.insert(*context), "context {} freed twice", context);
            }
            actual.push(effect);
        }
        prop_assert_eq!(
            sorted(&actual),
            sorted(&expected),
            "effects of a step (tick: {})",
            is_tick
        );

        // Entries, views and counters agree.
        for i in 0..IDS {
            for m in Module::ALL {
                let view = liveness.entry(instance(i), m);
                let want = model.entry((i, m));
                prop_assert_eq!(view.is_some(), want.is_some(), "presence of {:?}", (i, m));
                if let (Some(view), Some(want)) = (view, want) {
                    let record = &model.instances[&i];
                    prop_assert_eq!(
                        view.last_seen,
                        Instant::from_nanos(record.last_seen + model.credited)
                    );
                    prop_assert_eq!(view.proven, record.proven);
                    prop_assert_eq!(view.building, want.context.is_none());
                }
            }
        }
        let status = liveness.status();
        prop_assert_eq!(status.tracked_entries, model.entries_len());
        prop_assert_eq!(status.reaped_total, model.reaped_total);
        prop_assert_eq!(status.process_exits_total, model.process_exits_total);
        prop_assert_eq!(status.stalls_total, model.stalls_total);

        // The next wake honours both promises of poll_timeout.
        let wake = liveness.poll_timeout().unwrap().as_nanos();
        let stall_watch = model.last_input + (Model::nanos(config.stall_threshold) / 2).max(1);
        prop_assert!(wake <= stall_watch);
        if config.reaping_enabled() {
            for record in model.instances.values() {
                let deadline = record.last_seen + model.window(record) + model.credited;
                // A wake at the last input is "at once" (left-over work, or overdue).
                prop_assert!(
                    wake <= (deadline + resolution).max(model.last_input),
                    "wake {} after deadline {} + resolution",
                    wake,
                    deadline
                );
            }
        }
    }

    // Every context handed in comes back exactly once.
    let end = Instant::from_nanos(now);
    for (ticket, _) in pending.drain(..) {
        let context = next_context;
        next_context += 1;
        handed.insert(context);
        liveness.context_built(end, ticket, context);
    }
    for i in 0..IDS {
        liveness.process_exited(end, instance(i));
    }
    while let Some(effect) = liveness.poll_effect() {
        if let Effect::FreeContext { context, .. } = effect {
            prop_assert!(freed.insert(context), "context {} freed twice", context);
        }
    }
    prop_assert_eq!(handed, freed, "every context comes back exactly once");
    prop_assert_eq!(liveness.status().tracked_entries, 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn registry_agrees_with_a_naive_full_scan_model(
        config in config(),
        budget in prop_oneof![Just(None), Just(Some(1u32)), Just(Some(2)), Just(Some(17))],
        ops in proptest::collection::vec(op(), 1..200),
    ) {
        run(config, budget, ops)?;
    }
}
