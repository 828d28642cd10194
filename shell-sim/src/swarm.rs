//! Swarms: each seed draws its own fault profile, runs it, heals everything and checks
//! that the system converged.
//!
//! A seed's profile is a pure function of the seed ([`draw`]), so `SEED=<n>` replays a
//! failure bit for bit. The phases: workers start; faults strike until `heal_at`; at
//! `heal_at` every fault ends (`HealAll`); the run then lasts long enough for every dead
//! worker's state to be reaped (G + R) and every live worker to recover, and ends with
//! the convergence check.

use crate::config::{
    Action, CutDirection, FaultEvent, HeartbeatStart, LinkSpec, ServerSpec, SimConfig, TokenChoice,
    WORKER_UID, WorkerSpec,
};
use crate::rng::Rng;
use crate::time::{MILLISECOND, Nanos, SECOND, as_seconds};
use kvwarden_core::Module;
use std::fmt::Write as _;

/// Draws the profile of `seed`: a short run with few workers and random faults.
pub fn draw(seed: u64) -> SimConfig {
    let mut rng = Rng::new(seed);
    let mut server = draw_server(&mut rng, seed);
    let (reap_timeout, registration_grace) = (server.reap_timeout, server.registration_grace);
    let count = rng.between(1, 6) as usize;
    let mut workers = Vec::with_capacity(count);
    let mut longest_interval = 0;
    for slot in 0..count {
        let spec = draw_worker(&mut rng, slot);
        longest_interval = longest_interval.max(spec.heartbeat_interval);
        workers.push(spec);
    }
    let fault_end = reap_timeout * rng.between(2, 6);
    let longest_fault = 2 * reap_timeout;
    let mut events = draw_faults(&mut rng, &workers, fault_end, longest_fault);
    let heal_at = fault_end + longest_fault + SECOND;
    events.push(FaultEvent {
        at: heal_at,
        action: Action::HealAll,
    });
    let settle = registration_grace + 2 * reap_timeout + 6 * longest_interval + 10 * SECOND;
    // Before the end every worker uses each of its registrations once, as a client
    // does: a module lost while another stayed tracked (a ping answers true if any
    // module is tracked) is found by its `not_registered` and re-registered. Without
    // this probe such a worker would hold nothing in that module until its next use.
    events.push(FaultEvent {
        at: heal_at + settle - 2 * longest_interval - 5 * SECOND,
        action: Action::Transfer((0..count).collect()),
    });
    events.sort_by_key(|e| e.at);
    // Drawn last, so that the profile above stays what it was before they existed:
    // frees that take time or never return (row 20), raw bytes (row 24).
    server.free_delay = rng.between(0, 50) * MILLISECOND;
    if rng.chance(0.1) {
        server.free_hang_rate = rng.unit() * 0.1;
    }
    for spec in &mut workers {
        if rng.chance(0.1) {
            spec.garbage_every = Some(rng.between(500, 10_000) * MILLISECOND);
        }
    }
    let run_seed = rng.next_u64();
    // L2 is drawn after everything else (the run's seed included), so that a profile
    // without it is what it was before L2 existed (rows 27–29).
    if rng.chance(0.3) {
        draw_l2(&mut rng, &mut server, &mut events, fault_end, longest_fault);
    }
    // Adversaries (rows 30–33), drawn after everything else for the same reason.
    let window = (fault_end, longest_interval);
    draw_adversaries(
        &mut rng,
        &mut server,
        &mut workers,
        &mut events,
        count,
        window,
    );
    events.sort_by_key(|e| e.at);
    SimConfig {
        name: format!("swarm seed {seed}"),
        seed: run_seed,
        duration: heal_at + settle,
        server,
        workers,
        events,
        bug: None,
        converge_at_end: true,
    }
}

/// The server's timings and faults; the pool file from a generator of its own.
fn draw_server(rng: &mut Rng, seed: u64) -> ServerSpec {
    let reap_timeout = rng.pick(&[30, 45, 60]) * SECOND;
    let resolution = rng.pick(&[250, 500, 1000]) * MILLISECOND;
    let registration_grace = reap_timeout * rng.between(1, 3);
    let build_delay_low = rng.between(1, 50) * MILLISECOND;
    let mut server = ServerSpec {
        reap_timeout,
        registration_grace,
        resolution,
        stall_threshold: 5 * SECOND,
        allow_short_timeouts: false,
        build_delay: (
            build_delay_low,
            build_delay_low + rng.between(0, 450) * MILLISECOND,
        ),
        build_failure_rate: if rng.chance(0.5) {
            0.0
        } else {
            rng.unit() * 0.2
        },
        copy_duration: if rng.chance(0.7) {
            0
        } else {
            rng.between(10, 2000) * MILLISECOND
        },
        exit_notice_delay: rng.between(1, 50) * MILLISECOND,
        free_delay: 0,
        free_hang_rate: 0.0,
        free_watchdog: 10 * SECOND,
        l2: crate::l2::L2Spec::default(),
        tcp_token: None,
        pool_file: false,
        scan_duration: MILLISECOND,
    };
    // Drawn from a generator of its own, so that every other draw of a seed stays what
    // it was before pool files were simulated.
    let mut persistence = Rng::new(seed ^ 0x706f_6f6c_6669_6c65);
    if persistence.chance(0.3) {
        server.pool_file = true;
        server.scan_duration = persistence.between(1, 3000) * MILLISECOND;
    }
    server
}

/// Worker `slot`: its start, heartbeat, traffic, modules and link.
fn draw_worker(rng: &mut Rng, slot: usize) -> WorkerSpec {
    let mut spec = WorkerSpec::new(format!("w{slot}"));
    spec.start_at = rng.between(0, 5000) * MILLISECOND;
    spec.heartbeat_interval = rng.pick(&[2, 5, 10]) * SECOND;
    spec.same_host = rng.chance(0.5);
    if rng.chance(0.5) {
        spec.traffic_every =
            Some(rng.between(500, 2 * spec.heartbeat_interval / MILLISECOND) * MILLISECOND);
        spec.heartbeat_start = match rng.between(0, 9) {
            0..=5 => HeartbeatStart::OnRegister,
            6..=8 => HeartbeatStart::OnFirstTransfer,
            // Transfers alone keep it registered (unproven, window G).
            _ => HeartbeatStart::Never,
        };
    }
    // A pre-liveness client now and then: loud, never healthy, never converges,
    // but every invariant still holds around it.
    spec.legacy_ping = rng.chance(0.03);
    spec.modules = match rng.between(0, 9) {
        0..=6 => vec![Module::ServerDriven],
        7 | 8 => vec![Module::ServerDriven, Module::EngineDriven],
        _ => vec![Module::EngineDriven],
    };
    spec.blend = rng.chance(0.3);
    spec.commit_after = rng.between(1, 500) * MILLISECOND;
    spec.link = LinkSpec {
        delay: rng.between(100, 20_000) * 1000,
        // Keep the worst delay under H / 2: a clean shutdown drains for H.
        jitter: rng.between(
            0,
            (spec.heartbeat_interval / 4).min(100 * MILLISECOND) / 1000,
        ) * 1000,
        loss: if rng.chance(0.5) {
            0.0
        } else {
            rng.unit() * 0.1
        },
        duplicate: if rng.chance(0.7) {
            0.0
        } else {
            rng.unit() * 0.05
        },
    };
    spec
}

/// The workers' and the server's faults until `fault_end`, each lasting at most
/// `longest_fault` where it is undone.
fn draw_faults(
    rng: &mut Rng,
    workers: &[WorkerSpec],
    fault_end: Nanos,
    longest_fault: Nanos,
) -> Vec<FaultEvent> {
    let count = workers.len();
    let mut events = Vec::new();
    let faults = rng.between(0, 10);
    for _ in 0..faults {
        let at = rng.between(5 * SECOND / MILLISECOND, fault_end / MILLISECOND) * MILLISECOND;
        let slot = rng.between(0, count as u64 - 1) as usize;
        let lasting = rng.between(SECOND / MILLISECOND, longest_fault / MILLISECOND) * MILLISECOND;
        let (action, undo) = match rng.between(0, 12) {
            0 => (Action::Crash(vec![slot]), None),
            1 => (Action::Restart(vec![slot]), None),
            2 => (Action::Freeze(vec![slot]), Some(Action::Thaw(vec![slot]))),
            3 => (
                Action::StarveHeartbeat(vec![slot]),
                Some(Action::FeedHeartbeat(vec![slot])),
            ),
            4 => (Action::Stop(vec![slot]), None),
            5 | 6 => {
                let direction = rng.pick(&[
                    CutDirection::Both,
                    CutDirection::ToServer,
                    CutDirection::ToWorker,
                ]);
                (
                    Action::Partition(vec![slot], direction),
                    Some(Action::Heal(vec![slot])),
                )
            }
            7 => (Action::ServerPause, Some(Action::ServerResume)),
            8 => (
                Action::ServerRestart {
                    down: rng.between(0, 10_000) * MILLISECOND,
                },
                None,
            ),
            9 => {
                let step = rng.between(1, 7200) as i64 * SECOND as i64;
                (
                    Action::ClockStep(if rng.chance(0.5) { step } else { -step }),
                    None,
                )
            }
            // An operator UNREGISTER without exit is row 14's scenario, not drawn here:
            // a worker that unregistered on purpose knows it, and a lost half of it
            // is not something the protocol promises to repair.
            10 | 11 => (Action::Register(vec![slot]), None),
            _ => {
                let mut link = workers[slot].link.clone();
                link.loss = rng.unit() * 0.5;
                (Action::SetLink(vec![slot], link), None)
            }
        };
        events.push(FaultEvent { at, action });
        if let Some(undo) = undo {
            events.push(FaultEvent {
                at: at + lasting,
                action: undo,
            });
        }
    }
    events
}

/// L2 with its delays and timeout, and its faults (server restarts among them).
fn draw_l2(
    rng: &mut Rng,
    server: &mut ServerSpec,
    events: &mut Vec<FaultEvent>,
    fault_end: Nanos,
    longest_fault: Nanos,
) {
    server.l2 = crate::l2::L2Spec {
        enabled: true,
        delay: rng.between(1, 20) * MILLISECOND,
        timeout: rng.between(20, 500) * MILLISECOND,
        queue_bytes: rng.pick(&[1 << 14, 1 << 20, 64 << 20]),
        corrupt_rate: if rng.chance(0.7) {
            0.0
        } else {
            rng.unit() * 0.3
        },
    };
    // Server restarts among them: a retrieve of a chunk stored before one misses
    // L1 and reads through L2 (hits, torn values).
    for _ in 0..rng.between(0, 5) {
        let at = rng.between(5 * SECOND / MILLISECOND, fault_end / MILLISECOND) * MILLISECOND;
        let lasting = rng.between(SECOND / MILLISECOND, longest_fault / MILLISECOND) * MILLISECOND;
        let (action, undo) = match rng.between(0, 6) {
            0 => (Action::L2Down, Action::L2Up),
            1 => (Action::L2Partition, Action::L2Up),
            2 => {
                let late = server.l2.timeout + rng.between(1, 2000) * MILLISECOND;
                (Action::L2Slow(late), Action::L2Up)
            }
            3 => (Action::L2Corrupt(rng.unit()), Action::L2Corrupt(0.0)),
            4 => (Action::L2Flaky(rng.unit() * 0.5), Action::L2Flaky(0.0)),
            _ => {
                let down = rng.between(0, 2000) * MILLISECOND;
                events.push(FaultEvent {
                    at,
                    action: Action::ServerRestart { down },
                });
                continue;
            }
        };
        events.push(FaultEvent { at, action });
        events.push(FaultEvent {
            at: at + lasting,
            action: undo,
        });
    }
    events.sort_by_key(|e| e.at);
}

/// Adversaries (rows 30–33): another tenant that poaches, an impostor of the same uid,
/// TCP peers with or without the token.
fn draw_adversaries(
    rng: &mut Rng,
    server: &mut ServerSpec,
    workers: &mut Vec<WorkerSpec>,
    events: &mut Vec<FaultEvent>,
    count: usize,
    (fault_end, longest_interval): (Nanos, Nanos),
) {
    let at_random = |rng: &mut Rng| {
        rng.between(5 * SECOND / MILLISECOND, fault_end / MILLISECOND) * MILLISECOND
    };
    if rng.chance(0.15) {
        // Another tenant, a worker of its own that poaches the others' keys.
        let slot = workers.len();
        let mut spec = WorkerSpec::new(format!("w{slot}"));
        spec.uid = WORKER_UID + 1;
        spec.start_at = rng.between(0, 5000) * MILLISECOND;
        spec.heartbeat_interval = longest_interval;
        spec.same_host = rng.chance(0.5);
        spec.traffic_every =
            Some(rng.between(500, 2 * longest_interval / MILLISECOND) * MILLISECOND);
        spec.link.delay = rng.between(100, 5000) * 1000;
        workers.push(spec);
        for _ in 0..rng.between(1, 12) {
            let at = at_random(rng);
            events.push(FaultEvent {
                at,
                action: Action::Poach(slot),
            });
        }
    }
    if count >= 2 && rng.chance(0.15) {
        // A worker of the same uid that names every instance it read from the status,
        // and squats ids right after server restarts.
        let impostor = rng.between(0, count as u64 - 1) as usize;
        for _ in 0..rng.between(1, 6) {
            let at = at_random(rng);
            events.push(FaultEvent {
                at,
                action: Action::Impersonate(impostor),
            });
        }
        let restarts: Vec<(u64, u64)> = events
            .iter()
            .filter_map(|e| match e.action {
                Action::ServerRestart { down } => Some((e.at, down)),
                _ => None,
            })
            .collect();
        for (at, down) in restarts {
            if rng.chance(0.7) {
                for at in [at - MILLISECOND, at + down + MILLISECOND] {
                    events.push(FaultEvent {
                        at,
                        action: Action::Impersonate(impostor),
                    });
                }
            }
        }
    }
    if rng.chance(0.1) {
        // A TCP peer, without the token, with a wrong one, or with the server's.
        if rng.chance(0.7) {
            server.tcp_token = Some(b"swarm-tcp-token-0123456789abcdef".to_vec());
        }
        for _ in 0..rng.between(1, 5) {
            let at = at_random(rng);
            let token = rng.pick(&[TokenChoice::Missing, TokenChoice::Wrong, TokenChoice::Right]);
            events.push(FaultEvent {
                at,
                action: Action::TcpProbe(token),
            });
        }
    }
}

/// The drawn parameters of a profile, for the failure report.
pub fn describe(cfg: &SimConfig) -> String {
    let s = &cfg.server;
    let mut text = format!(
        "  run seed {}, duration {:.1}s\n  server: T={:.1}s G={:.1}s R={:.3}s stall={:.1}s build {:.3}-{:.3}s fail {:.3} copy {:.3}s exit notice {:.3}s free {:.3}s hang {:.3} tcp token {}\n",
        cfg.seed,
        as_seconds(cfg.duration),
        as_seconds(s.reap_timeout),
        as_seconds(s.registration_grace),
        as_seconds(s.resolution),
        as_seconds(s.stall_threshold),
        as_seconds(s.build_delay.0),
        as_seconds(s.build_delay.1),
        s.build_failure_rate,
        as_seconds(s.copy_duration),
        as_seconds(s.exit_notice_delay),
        as_seconds(s.free_delay),
        s.free_hang_rate,
        s.tcp_token.is_some(),
    );
    if s.pool_file {
        let _ = writeln!(
            text,
            "  pool file: sealed, adopted on restart, scan {:.3}s",
            as_seconds(s.scan_duration)
        );
    }
    if s.l2.enabled {
        let _ = writeln!(
            text,
            "  l2: delay {:.3}ms timeout {:.3}ms queue {} bytes corrupt {:.3}",
            s.l2.delay as f64 / 1e6,
            s.l2.timeout as f64 / 1e6,
            s.l2.queue_bytes,
            s.l2.corrupt_rate,
        );
    }
    for w in &cfg.workers {
        let _ = writeln!(
            text,
            "  {}: uid {} start {:.3}s H={:.0}s same_host={} traffic={:?} hb_start={:?} modules={:?} blend={} garbage={:?} link: delay {:.3}ms jitter {:.3}ms loss {:.3} dup {:.3}",
            w.name,
            w.uid,
            as_seconds(w.start_at),
            as_seconds(w.heartbeat_interval),
            w.same_host,
            w.traffic_every.map(as_seconds),
            w.heartbeat_start,
            w.modules.iter().map(|m| m.label()).collect::<Vec<_>>(),
            w.blend,
            w.garbage_every.map(as_seconds),
            w.link.delay as f64 / 1e6,
            w.link.jitter as f64 / 1e6,
            w.link.loss,
            w.link.duplicate,
        );
    }
    for e in &cfg.events {
        let _ = writeln!(text, "  t={:.3}s {:?}", as_seconds(e.at), e.action);
    }
    text
}

/// Parses `A..B` (B excluded) or a single seed `A`.
pub fn parse_range(text: &str) -> Result<std::ops::Range<u64>, String> {
    let bad = || format!("--seeds {text:?}: expected A..B with A < B (B excluded), or one seed N");
    match text.split_once("..") {
        Some((a, b)) => {
            let a: u64 = a.trim().parse().map_err(|_| bad())?;
            let b: u64 = b.trim().parse().map_err(|_| bad())?;
            if a >= b {
                return Err(bad());
            }
            Ok(a..b)
        }
        None => {
            let a: u64 = text.trim().parse().map_err(|_| bad())?;
            Ok(a..a.checked_add(1).ok_or_else(bad)?)
        }
    }
}

/// Reads a regression list: one seed per line, `#` starts a comment.
pub fn parse_seed_list(text: &str) -> Result<Vec<u64>, String> {
    let mut seeds = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let seed = line.parse().map_err(|_| {
            format!(
                "line {}: {line:?} is not a seed (an unsigned integer)",
                number + 1
            )
        })?;
        seeds.push(seed);
    }
    Ok(seeds)
}
