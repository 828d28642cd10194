//! Arbitrary sequences of every core input with arbitrary time steps.
//!
//! Oracles: no panic; every effect well-formed (a context comes back once, and only one
//! that was handed in; DropBlendState only for an instance with no entry left); no reap
//! before its deadline, checked against the raw time of the instance's last evidence
//! (stall credit can only make the core's silence shorter than that); `now` going
//! backwards never moves an entry's `last_seen` back.
#![no_main]

use arbitrary::Arbitrary;
use kvwarden_core::{
    BuildTicket, Config, Effect, FreeCause, InstanceId, Instant, Liveness, Module, Registration,
};
use libfuzzer_sys::fuzz_target;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

#[derive(Arbitrary, Debug)]
enum Op {
    Step(u32),
    StepBack(u16),
    BigStep(u16),
    Ping(Option<u8>),
    Register(u8, bool),
    Built(u8),
    BuildFailed(u8),
    Unregister(u8, bool),
    Transfer(u8, bool),
    ProcessExited(u8),
    Tick,
    TickAtWake,
}

#[derive(Arbitrary, Debug)]
struct Input {
    reap_timeout_ms: u16,
    extra_grace_ms: u16,
    resolution_divisor: u8,
    stall_threshold_ms: u16,
    ops: Vec<Op>,
}

fn module(engine: bool) -> Module {
    if engine {
        Module::EngineDriven
    } else {
        Module::ServerDriven
    }
}

fn instance(raw: u8) -> InstanceId {
    InstanceId::new(u64::from(raw % 8) + 1).unwrap()
}

/// Evidence refreshes the whole instance: every module's entry (failure-modes row 26).
fn refresh(evidence: &mut BTreeMap<(InstanceId, Module), u64>, instance: InstanceId, at: u64) {
    for m in Module::ALL {
        if let Some(seen) = evidence.get_mut(&(instance, m)) {
            *seen = at;
        }
    }
}

fuzz_target!(|input: Input| {
    let reap_timeout = Duration::from_millis(u64::from(input.reap_timeout_ms));
    let config = Config {
        reap_timeout,
        registration_grace: reap_timeout + Duration::from_millis(u64::from(input.extra_grace_ms)),
        resolution: (reap_timeout / (u32::from(input.resolution_divisor) + 8))
            .max(Duration::from_nanos(1)),
        stall_threshold: Duration::from_millis(u64::from(input.stall_threshold_ms) + 1),
    };
    let Ok(mut liveness) =
        Liveness::<u32>::new_with_floor(config.clone(), Instant::ZERO, Duration::ZERO)
    else {
        return;
    };
    let mut now = 0u64;
    let mut latest = 0u64;
    let mut pending: Vec<BuildTicket> = Vec::new();
    let mut next_context = 0u32;
    let mut handed = BTreeSet::new();
    let mut freed = BTreeSet::new();
    // Raw time of each present entry's last evidence.
    let mut evidence: BTreeMap<(InstanceId, Module), u64> = BTreeMap::new();

    for op in input.ops.into_iter().take(2000) {
        let t = Instant::from_nanos(now);
        let steps = matches!(op, Op::Step(_) | Op::StepBack(_) | Op::BigStep(_));
        let no_build = matches!(op, Op::Built(_) | Op::BuildFailed(_)) && pending.is_empty();
        if !steps && !no_build {
            // The latest instant the core has been fed.
            latest = latest.max(now);
        }
        match op {
            Op::Step(ns) => now = now.saturating_add(u64::from(ns)),
            Op::StepBack(ms) => now = now.saturating_sub(u64::from(ms) * 1_000_000),
            Op::BigStep(ms) => now = now.saturating_add(u64::from(ms) * 100_000_000),
            Op::Ping(who) => {
                liveness.ping(t, who.map(instance));
                if let Some(raw) = who {
                    for m in Module::ALL {
                        if let Some(seen) = evidence.get_mut(&(instance(raw), m)) {
                            *seen = latest;
                        }
                    }
                }
            }
            Op::Register(raw, engine) => {
                let key = (instance(raw), module(engine));
                if let Registration::Build(ticket) = liveness.register(t, key.0, key.1) {
                    pending.push(ticket);
                }
                evidence.insert(key, latest);
                refresh(&mut evidence, key.0, latest);
            }
            Op::Built(pick) | Op::BuildFailed(pick) if !pending.is_empty() => {
                let ticket = pending.swap_remove(usize::from(pick) % pending.len());
                let key = (ticket.instance(), ticket.module());
                if matches!(op, Op::Built(_)) {
                    next_context += 1;
                    handed.insert(next_context);
                    let was_building = liveness.entry(key.0, key.1).is_some_and(|v| v.building);
                    liveness.context_built(t, ticket, next_context);
                    // A stale ticket (its entry replaced) refreshes nothing.
                    let now_ready = liveness.entry(key.0, key.1).is_some_and(|v| !v.building);
                    if was_building && now_ready {
                        refresh(&mut evidence, key.0, latest);
                    }
                } else {
                    liveness.context_build_failed(t, ticket);
                }
            }
            Op::Built(_) | Op::BuildFailed(_) => {}
            Op::Unregister(raw, engine) => {
                liveness.unregister(t, instance(raw), module(engine));
            }
            Op::Transfer(raw, engine) => {
                let key = (instance(raw), module(engine));
                let _ = liveness.transfer(t, key.0, key.1);
                refresh(&mut evidence, key.0, latest);
            }
            Op::ProcessExited(raw) => {
                liveness.process_exited(t, instance(raw));
            }
            Op::Tick => liveness.handle_timeout(t),
            Op::TickAtWake => {
                let wake = liveness
                    .poll_timeout()
                    .expect("poll_timeout is always Some");
                assert!(wake.as_nanos() <= latest + config.stall_threshold.as_nanos() as u64);
                now = now.max(wake.as_nanos());
                latest = latest.max(now);
                liveness.handle_timeout(Instant::from_nanos(now));
            }
        }
        while let Some(effect) = liveness.poll_effect() {
            match effect {
                Effect::FreeContext {
                    instance,
                    module,
                    context,
                    cause,
                } => {
                    assert!(handed.contains(&context), "freed a context never handed in");
                    assert!(freed.insert(context), "context {context} freed twice");
                    if let FreeCause::Reaped { silence, proven } = cause {
                        let window = if proven {
                            config.reap_timeout
                        } else {
                            config.registration_grace
                        };
                        assert!(
                            silence > window,
                            "reaped with silence {silence:?} <= {window:?}"
                        );
                        let seen = evidence[&(instance, module)];
                        let raw_silence = Duration::from_nanos(latest - seen);
                        assert!(
                            raw_silence >= silence,
                            "reaped {raw_silence:?} after evidence, claims {silence:?}"
                        );
                    }
                }
                Effect::DropBlendState { instance } => {
                    for m in Module::ALL {
                        assert!(
                            liveness.entry(instance, m).is_none(),
                            "blend state dropped with an entry left"
                        );
                    }
                }
                Effect::StallDetected { gap } => assert!(gap > config.stall_threshold),
            }
        }
        evidence.retain(|&(i, m), _| liveness.entry(i, m).is_some());
        for (&(i, m), &seen) in &evidence {
            let view = liveness.entry(i, m).unwrap();
            // The stall-corrected clock, seen through EntryView, never lags raw evidence.
            assert!(
                view.last_seen.as_nanos() >= seen,
                "last_seen moved back: {view:?} < {seen} for {i:?}/{m:?} latest {latest} now {now}"
            );
        }
    }
});
