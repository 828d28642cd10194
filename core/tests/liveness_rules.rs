//! Every rule of the liveness registry (see `docs/design.md`), one test per behaviour.

mod support;

use kvwarden_core::{
    Config, Effect, FreeCause, Instant, Liveness, Module, Registration, TransferError,
};
use std::time::Duration;
use support::*;

fn short_config() -> Config {
    Config {
        reap_timeout: secs(30.0),
        registration_grace: secs(60.0),
        resolution: secs(1.0),
        stall_threshold: secs(5.0),
    }
}

#[test]
fn proven_entry_is_reaped_after_reap_timeout_never_before() {
    let mut shell = Shell::with_defaults();
    let worker = id(7);
    let context = shell.register_built(worker, SD);
    shell.run_until(at(10.0));
    assert!(shell.ping(worker));

    shell.run_until(at(130.0)); // silence exactly 120 s: not yet
    assert!(shell.tracked(worker, SD));
    assert!(shell.frees().is_empty());

    shell.run_until(at(131.0));
    let frees = shell.frees();
    assert_eq!(frees.len(), 1);
    let (when, instance, module, freed, cause) = frees[0];
    assert_eq!((instance, module, freed), (worker, SD, context));
    assert!(when > at(130.0) && when <= at(131.0), "reaped at {when:?}");
    match cause {
        FreeCause::Reaped { silence, proven } => {
            assert!(proven);
            assert!(
                silence > secs(120.0) && silence <= secs(121.0),
                "{silence:?}"
            );
        }
        other => panic!("unexpected cause {other:?}"),
    }
    assert!(!shell.tracked(worker, SD));
    assert_eq!(shell.liveness.status().reaped_total, 1);
}

#[test]
fn never_pinged_entry_is_reaped_after_registration_grace_never_before() {
    let mut shell = Shell::with_defaults();
    let worker = id(8);
    shell.register_built(worker, SD);

    shell.run_until(at(3600.0));
    assert!(
        shell.tracked(worker, SD),
        "warm-up worker reaped at the reap timeout"
    );
    shell.run_until(at(3601.0));
    assert!(!shell.tracked(worker, SD));
    let (when, .., cause) = shell.frees()[0];
    assert!(when > at(3600.0) && when <= at(3601.0));
    assert!(matches!(cause, FreeCause::Reaped { proven: false, .. }));
}

#[test]
fn silence_equal_to_the_window_is_not_due_one_nanosecond_more_is() {
    let mut shell = Shell::new(short_config());
    let worker = id(9);
    shell.register_built(worker, SD);
    assert!(shell.ping(worker));
    let deadline = at(30.0);

    shell.run_until(deadline);
    assert!(shell.tracked(worker, SD), "silence == window must not reap");
    shell.run_until(deadline + Duration::from_nanos(1));
    // Due now; reaped by the first wake at or after the end of its tick.
    shell.run_until(deadline + secs(1.0));
    assert!(!shell.tracked(worker, SD));

    // A re-check that lands exactly on the deadline: registered at 31 s (first check
    // at the end of the tick of 61 s, i.e. 62 s), pinged at 32 s, so at 62 s its
    // silence is exactly the window.
    assert_eq!(shell.now, at(31.0));
    let other = id(90);
    shell.register_built(other, SD);
    shell.run_until(at(32.0));
    assert!(shell.ping(other));
    shell.run_until(at(62.0));
    assert!(
        shell.tracked(other, SD),
        "silence == window at a re-check must not reap"
    );
    shell.run_until(at(63.0));
    assert!(!shell.tracked(other, SD));
}

#[test]
fn every_reap_is_within_resolution_of_its_deadline() {
    let config = Config {
        resolution: Duration::from_millis(250),
        ..short_config()
    };
    let mut shell = Shell::new(config);
    let workers: Vec<_> = (1..=40).map(id).collect();
    for (i, &worker) in workers.iter().enumerate() {
        shell.run_until(at(i as f64 * 0.37));
        shell.register_built(worker, SD);
        shell.ping(worker);
    }
    shell.run_until(at(100.0));
    let frees = shell.frees();
    assert_eq!(frees.len(), workers.len());
    for (i, (when, instance, ..)) in frees.iter().enumerate() {
        let deadline = at(i as f64 * 0.37) + secs(30.0);
        assert_eq!(*instance, workers[i]);
        assert!(*when > deadline, "{instance:?} reaped early at {when:?}");
        assert!(
            *when <= deadline + Duration::from_millis(250),
            "{instance:?} reaped late at {when:?}, deadline {deadline:?}"
        );
    }
}

#[test]
fn first_ping_after_warm_up_shortens_the_window_to_the_reap_timeout() {
    let mut shell = Shell::with_defaults();
    let worker = id(10);
    shell.register_built(worker, SD);
    shell.run_until(at(500.0));
    assert!(shell.ping(worker)); // proven from now on: window 120 s, not 3600 s
    shell.run_until(at(620.0));
    assert!(shell.tracked(worker, SD));
    shell.run_until(at(621.0));
    assert!(
        !shell.tracked(worker, SD),
        "a proven worker silent for 121 s must go"
    );
}

#[test]
fn reaping_disabled_never_reaps_but_pings_answer() {
    let mut shell = Shell::new(Config::from_secs(0.0, 0.0).unwrap());
    let worker = id(11);
    shell.register_built(worker, SD);
    let unknown = id(12);
    shell.run_until(at(1_000_000.0));
    assert!(shell.tracked(worker, SD));
    assert!(shell.ping(worker));
    assert!(!shell.ping(unknown));
    shell.run_until(at(10_000_000.0));
    assert!(shell.frees().is_empty());
    let status = shell.liveness.status();
    assert!(!status.enabled);
    assert_eq!(status.reaped_total, 0);
    // The process-exit proof still frees.
    assert!(shell.liveness.process_exited(shell.now, worker));
    shell.drain();
    assert_eq!(shell.frees().len(), 1);
}

#[test]
fn ping_never_inserts_and_answers_false_for_unknown_true_for_none() {
    let mut shell = Shell::with_defaults();
    assert!(!shell.ping(id(13)));
    assert!(shell.liveness.ping(shell.now, None));
    assert!(!shell.tracked(id(13), SD) && !shell.tracked(id(13), ED));
    assert_eq!(shell.liveness.status().tracked_entries, 0);
}

#[test]
fn ping_latches_proven_on_every_module_entry_of_the_instance() {
    let mut shell = Shell::with_defaults();
    let worker = id(14);
    shell.register_built(worker, SD);
    let _building = shell.register_building(worker, ED);
    shell.run_until(at(5.0));
    assert!(shell.ping(worker));
    for module in Module::ALL {
        let view = shell.liveness.entry(worker, module).unwrap();
        assert!(view.proven, "{module:?} not latched");
        assert_eq!(view.last_seen, at(5.0));
    }
    assert!(shell.liveness.entry(worker, ED).unwrap().building);
    assert!(!shell.liveness.entry(worker, SD).unwrap().building);
}

#[test]
fn register_on_present_entry_refreshes_without_latching_or_rebuilding() {
    let mut shell = Shell::with_defaults();
    let worker = id(15);
    shell.register_built(worker, SD);
    shell.run_until(at(40.0));
    assert_eq!(
        shell.liveness.register(shell.now, worker, SD),
        Registration::Refreshed
    );
    let view = shell.liveness.entry(worker, SD).unwrap();
    assert_eq!(view.last_seen, at(40.0));
    assert!(!view.proven, "register must not latch proven");
    // Still building: a second register is also a refresh, not a second build.
    let other = id(16);
    let ticket = shell.register_building(other, SD);
    assert_eq!(
        shell.liveness.register(shell.now, other, SD),
        Registration::Refreshed
    );
    shell.build(ticket);
    // Proven stays latched across a refresh.
    shell.ping(worker);
    assert_eq!(
        shell.liveness.register(shell.now, worker, SD),
        Registration::Refreshed
    );
    assert!(shell.liveness.entry(worker, SD).unwrap().proven);
    assert!(shell.frees().is_empty());
}

#[test]
fn transfers_refresh_liveness_without_latching_proven() {
    let mut shell = Shell::new(short_config());
    let worker = id(17);
    let context = shell.register_built(worker, SD);
    shell.ping(worker);
    // The heartbeat starves; transfers keep coming every 20 s for 10 minutes.
    for step in 1..=30 {
        shell.run_until(at(step as f64 * 20.0));
        assert_eq!(shell.liveness.transfer(shell.now, worker, SD), Ok(&context));
    }
    assert!(
        shell.tracked(worker, SD),
        "a transferring worker was reaped"
    );
    let view = shell.liveness.entry(worker, SD).unwrap();
    assert_eq!(view.last_seen, at(600.0));

    let fresh = id(18);
    shell.register_built(fresh, SD);
    shell.liveness.transfer(shell.now, fresh, SD).unwrap();
    assert!(!shell.liveness.entry(fresh, SD).unwrap().proven);
}

#[test]
fn transfer_errors_name_absent_and_building_entries() {
    let mut shell = Shell::with_defaults();
    assert_eq!(
        shell.liveness.transfer(shell.now, id(19), SD),
        Err(TransferError::NotRegistered)
    );
    let ticket = shell.register_building(id(19), SD);
    assert_eq!(
        shell.liveness.transfer(shell.now, id(19), SD),
        Err(TransferError::NotReady)
    );
    assert_eq!(
        shell.liveness.transfer(shell.now, id(19), ED),
        Err(TransferError::NotRegistered)
    );
    let context = shell.build(ticket);
    assert_eq!(shell.liveness.transfer(shell.now, id(19), SD), Ok(&context));
}

#[test]
fn unregister_returns_the_context_once_and_a_second_unregister_is_harmless() {
    let mut shell = Shell::with_defaults();
    let worker = id(20);
    let context = shell.register_built(worker, SD);
    assert!(shell.liveness.unregister(shell.now, worker, SD));
    assert!(!shell.liveness.unregister(shell.now, worker, SD));
    shell.drain();
    let frees = shell.frees();
    assert_eq!(frees.len(), 1);
    assert_eq!(frees[0].3, context);
    assert_eq!(frees[0].4, FreeCause::Unregistered);
    assert!(!shell.liveness.unregister(shell.now, id(21), ED));
}

#[test]
fn removed_entry_never_comes_back_by_itself() {
    let mut shell = Shell::with_defaults();
    let worker = id(22);
    shell.register_built(worker, SD);
    shell.liveness.unregister(shell.now, worker, SD);
    assert!(!shell.ping(worker));
    assert_eq!(
        shell.liveness.transfer(shell.now, worker, SD),
        Err(TransferError::NotRegistered)
    );
    shell.run_until(at(10_000.0));
    assert!(!shell.tracked(worker, SD));
}

#[test]
fn a_context_built_after_unregister_is_freed_once_on_arrival() {
    let mut shell = Shell::with_defaults();
    let worker = id(23);
    let ticket = shell.register_building(worker, SD);
    assert!(shell.liveness.unregister(shell.now, worker, SD));
    shell.drain();
    assert!(
        shell.frees().is_empty(),
        "nothing to free before the build finishes"
    );
    let context = shell.build(ticket);
    assert_eq!(
        shell.frees().iter().map(|f| (f.3, f.4)).collect::<Vec<_>>(),
        vec![(context, FreeCause::Cancelled)]
    );
    assert!(!shell.tracked(worker, SD));
}

#[test]
fn a_context_built_after_process_exit_is_freed_once_on_arrival() {
    let mut shell = Shell::with_defaults();
    let worker = id(24);
    let ticket = shell.register_building(worker, SD);
    assert!(shell.liveness.process_exited(shell.now, worker));
    let context = shell.build(ticket);
    let frees = shell.frees();
    assert_eq!(frees.len(), 1);
    assert_eq!((frees[0].3, frees[0].4), (context, FreeCause::Cancelled));
}

#[test]
fn a_context_built_after_a_reap_is_freed_once_on_arrival() {
    let mut shell = Shell::new(short_config());
    let worker = id(25);
    let ticket = shell.register_building(worker, SD);
    shell.run_until(at(70.0)); // grace 60 s passed while the build hung
    assert!(!shell.tracked(worker, SD));
    assert_eq!(shell.liveness.status().reaped_total, 1);
    assert!(shell.frees().is_empty());
    let context = shell.build(ticket);
    assert_eq!(shell.frees().len(), 1);
    assert_eq!(shell.frees()[0].3, context);
}

#[test]
fn a_stale_build_after_re_registration_is_freed_and_the_fresh_one_kept() {
    let mut shell = Shell::with_defaults();
    let worker = id(26);
    let old_ticket = shell.register_building(worker, SD);
    shell.liveness.unregister(shell.now, worker, SD);
    let new_ticket = shell.register_building(worker, SD);
    let old_context = shell.build(old_ticket);
    assert!(shell.liveness.entry(worker, SD).unwrap().building);
    let new_context = shell.build(new_ticket);
    assert_eq!(
        shell.liveness.transfer(shell.now, worker, SD),
        Ok(&new_context)
    );
    let frees = shell.frees();
    assert_eq!(frees.len(), 1);
    assert_eq!(
        (frees[0].3, frees[0].4),
        (old_context, FreeCause::Cancelled)
    );
}

#[test]
fn a_failed_build_removes_the_entry_and_frees_nothing() {
    let mut shell = Shell::with_defaults();
    let worker = id(27);
    let ticket = shell.register_building(worker, SD);
    shell.liveness.context_build_failed(shell.now, ticket);
    shell.drain();
    assert!(!shell.tracked(worker, SD));
    assert!(shell.frees().is_empty());
    assert_eq!(shell.blend_drops(worker).len(), 1);
    // A register afterwards builds afresh.
    assert!(matches!(
        shell.liveness.register(shell.now, worker, SD),
        Registration::Build(_)
    ));
}

#[test]
fn a_failed_build_of_an_entry_already_gone_changes_nothing() {
    let mut shell = Shell::with_defaults();
    let worker = id(28);
    let old_ticket = shell.register_building(worker, SD);
    shell.liveness.unregister(shell.now, worker, SD);
    let new_ticket = shell.register_building(worker, SD);
    shell.liveness.context_build_failed(shell.now, old_ticket);
    shell.drain();
    assert!(shell.liveness.entry(worker, SD).unwrap().building);
    shell.build(new_ticket);
    assert!(shell.tracked(worker, SD));
}

#[test]
fn drop_blend_state_comes_once_after_the_instances_last_entry() {
    let mut shell = Shell::with_defaults();
    let worker = id(29);
    shell.register_built(worker, SD);
    shell.register_built(worker, ED);
    shell.liveness.unregister(shell.now, worker, SD);
    shell.drain();
    assert!(shell.blend_drops(worker).is_empty(), "an entry is left");
    shell.liveness.unregister(shell.now, worker, ED);
    shell.drain();
    assert_eq!(shell.blend_drops(worker).len(), 1);
    // After the last FreeContext of the instance.
    let last = shell.effects.len() - 1;
    assert!(matches!(
        shell.effects[last].1,
        Effect::DropBlendState { .. }
    ));
    assert!(matches!(
        shell.effects[last - 1].1,
        Effect::FreeContext {
            module: Module::EngineDriven,
            ..
        }
    ));
    shell.liveness.unregister(shell.now, worker, ED);
    shell.drain();
    assert_eq!(shell.blend_drops(worker).len(), 1);
}

#[test]
fn process_exit_frees_every_entry_of_the_instance_and_nothing_else() {
    let mut shell = Shell::with_defaults();
    let worker = id(30);
    let bystander = id(31);
    let a = shell.register_built(worker, SD);
    let b = shell.register_built(worker, ED);
    shell.register_built(bystander, SD);
    shell.run_until(at(1.0));
    assert!(shell.liveness.process_exited(shell.now, worker));
    shell.drain();
    let mut freed: Vec<_> = shell.frees().iter().map(|f| (f.3, f.4)).collect();
    freed.sort_by_key(|f| f.0);
    assert_eq!(
        freed,
        vec![(a, FreeCause::ProcessExited), (b, FreeCause::ProcessExited)]
    );
    assert_eq!(shell.blend_drops(worker).len(), 1);
    assert!(shell.tracked(bystander, SD));
    assert!(!shell.liveness.process_exited(shell.now, worker));
    assert_eq!(shell.liveness.status().process_exits_total, 1);
}

#[test]
fn time_going_backwards_changes_nothing() {
    let mut shell = Shell::new(short_config());
    let worker = id(32);
    shell.register_built(worker, SD);
    shell.run_until(at(4.0));
    shell.ping(worker);
    // An input stamped in the past counts as the latest instant seen.
    assert!(shell.liveness.ping(at(1.0), Some(worker)));
    assert_eq!(shell.liveness.entry(worker, SD).unwrap().last_seen, at(4.0));
    shell.liveness.handle_timeout(Instant::ZERO);
    assert!(shell.liveness.poll_timeout().unwrap() >= at(4.0));
    // And the deadline still counts from 4 s.
    shell.run_until(at(34.0));
    assert!(shell.tracked(worker, SD));
    shell.run_until(at(35.0));
    assert!(!shell.tracked(worker, SD));
}

#[test]
fn a_paused_server_reaps_nobody_on_resume_and_reports_the_stall() {
    let mut shell = Shell::new(short_config());
    let worker = id(33);
    shell.register_built(worker, SD);
    shell.ping(worker);
    shell.run_until(at(20.0));
    shell.ping(worker);
    // The server is SIGSTOPped for 500 s: no wake, no input. On resume the queued
    // ping is processed first, then time.
    shell.now = at(520.0);
    assert!(shell.ping(worker));
    shell.liveness.handle_timeout(shell.now);
    shell.drain();
    assert!(
        shell.tracked(worker, SD),
        "a stall of the server reaped a live worker"
    );
    assert_eq!(shell.stalls(), vec![secs(500.0)]);
    assert_eq!(shell.liveness.status().stalls_total, 1);

    // Even without a queued ping, the gap is not the worker's silence...
    shell.run_until(at(540.0));
    shell.now = at(1540.0);
    shell.liveness.handle_timeout(shell.now);
    shell.drain();
    assert!(shell.tracked(worker, SD));
    // ...but the silence around it still counts: 20 s before + 11 s after > 30 s.
    shell.run_until(at(1551.0));
    assert!(!shell.tracked(worker, SD));
    assert_eq!(shell.liveness.status().stalls_total, 2);
}

#[test]
fn a_gap_at_the_stall_threshold_is_not_a_stall() {
    let mut shell = Shell::new(short_config());
    shell.now = at(5.0);
    shell.liveness.handle_timeout(shell.now);
    shell.drain();
    assert!(shell.stalls().is_empty());
    shell.now = at(10.000_000_001);
    shell.liveness.handle_timeout(shell.now);
    shell.drain();
    assert_eq!(shell.stalls().len(), 1);
}

#[test]
fn poll_timeout_is_never_later_than_deadline_plus_resolution_or_half_the_stall_threshold() {
    let mut shell = Shell::new(short_config());
    let worker = id(34);
    // Idle: the stall watch alone.
    assert_eq!(shell.liveness.poll_timeout(), Some(at(2.5)));
    shell.register_built(worker, SD);
    shell.ping(worker);
    let mut now = 0.0;
    while now < 29.0 {
        let wake = shell.liveness.poll_timeout().unwrap();
        assert!(wake <= shell.now + secs(2.5));
        now += 2.5;
        shell.run_until(at(now));
    }
    shell.run_until(at(29.5));
    // The deadline is 30 s; the wake that reaps is at most 1 s after it.
    assert!(shell.liveness.poll_timeout().unwrap() <= at(31.0));
}

#[test]
fn status_counts_entries_reaps_exits_and_stalls() {
    let mut shell = Shell::new(short_config());
    let status = shell.liveness.status();
    assert!(status.enabled);
    assert_eq!(status.reap_timeout, secs(30.0));
    assert_eq!(status.registration_grace, secs(60.0));
    shell.register_built(id(1), SD);
    shell.register_built(id(1), ED);
    let _building = shell.register_building(id(2), SD);
    shell.register_built(id(3), SD);
    assert_eq!(shell.liveness.status().tracked_entries, 4);
    shell.liveness.process_exited(shell.now, id(3));
    shell.ping(id(1));
    shell.run_until(at(31.0));
    let status = shell.liveness.status();
    assert_eq!(
        status.tracked_entries, 1,
        "only the never-pinged building entry is left"
    );
    assert_eq!(status.reaped_total, 2);
    assert_eq!(status.process_exits_total, 1);
    assert_eq!(status.stalls_total, 0);
}

#[test]
fn touching_entries_does_not_schedule_more_expiry_work() {
    let mut shell = Shell::with_defaults();
    for raw in 1..=1000 {
        shell.register_built(id(raw), SD);
    }
    assert_eq!(shell.liveness.scheduled_len(), 1000);
    for round in 1..=10 {
        shell.run_until(at(round as f64));
        for raw in 1..=1000 {
            shell.ping(id(raw));
            shell.liveness.transfer(shell.now, id(raw), SD).unwrap();
        }
    }
    assert_eq!(
        shell.liveness.scheduled_len(),
        1000,
        "a touch must not add expiry items"
    );
}

#[test]
fn a_short_floor_admits_test_timeouts_and_the_default_constructor_refuses_them() {
    let config = Config {
        reap_timeout: secs(2.0),
        registration_grace: secs(2.0),
        resolution: Duration::from_millis(100),
        stall_threshold: secs(5.0),
    };
    assert!(Liveness::<()>::new(config.clone(), Instant::ZERO).is_err());
    let mut liveness =
        Liveness::<()>::new_with_floor(config, Instant::ZERO, Duration::ZERO).unwrap();
    let Registration::Build(ticket) = liveness.register(Instant::ZERO, id(1), SD) else {
        panic!("absent entry must build");
    };
    liveness.context_built(Instant::ZERO, ticket, ());
    let mut now = Instant::ZERO;
    while liveness.entry(id(1), SD).is_some() {
        now = liveness.poll_timeout().unwrap();
        liveness.handle_timeout(now);
    }
    assert!(now > at(2.0) && now <= at(2.1), "reaped at {now:?}");
}

// Failure-modes row 26: an instance is one process, its registrations live and die
// together.

/// Drives `handle_timeout` at `now` until the core stops asking for a turn at once;
/// returns the effects of each call separately.
fn turns_at(shell: &mut Shell, now: Instant) -> Vec<Vec<Effect<Ctx>>> {
    shell.now = now;
    let mut turns = Vec::new();
    loop {
        shell.liveness.handle_timeout(now);
        turns.push(std::iter::from_fn(|| shell.liveness.poll_effect()).collect());
        if shell.liveness.poll_timeout().is_none_or(|wake| wake > now) {
            return turns;
        }
    }
}

#[test]
fn row_26_a_module_registered_after_the_last_ping_is_proven_and_reaped_with_its_sibling() {
    let mut shell = Shell::with_defaults();
    let worker = id(40);
    let sd = shell.register_built(worker, SD);
    shell.run_until(at(5.0));
    assert!(shell.ping(worker));
    shell.run_until(at(10.0));
    let ed = shell.register_built(worker, ED); // after the last ping; then the heartbeat stalls
    let view = shell.liveness.entry(worker, ED).unwrap();
    assert!(view.proven, "proven is the instance's, not the entry's");
    assert_eq!(view.last_seen, at(10.0));
    assert_eq!(
        shell.liveness.entry(worker, SD).unwrap().last_seen,
        at(10.0)
    );

    // Silence of exactly T since the register: both held, nothing freed.
    shell.run_until(at(130.0));
    assert!(shell.tracked(worker, SD) && shell.tracked(worker, ED));
    assert!(shell.frees().is_empty());

    // One resolution later the instance goes whole, in one call, T (not G) after the
    // register: a FreeContext each, then one DropBlendState.
    let mut before = at(130.0);
    let mut reaping_turn = None;
    while reaping_turn.is_none() {
        let wake = shell.liveness.poll_timeout().unwrap();
        assert!(wake > before && wake <= at(131.0), "wake {wake:?}");
        before = wake;
        reaping_turn = turns_at(&mut shell, wake)
            .into_iter()
            .find(|effects| !effects.is_empty());
    }
    let effects = reaping_turn.unwrap();
    assert_eq!(effects.len(), 3, "{effects:?}");
    let mut freed: Vec<(Module, Ctx, bool)> = effects[..2]
        .iter()
        .map(|effect| match effect {
            Effect::FreeContext {
                instance,
                module,
                context,
                cause: FreeCause::Reaped { proven, .. },
            } if *instance == worker => (*module, *context, *proven),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    freed.sort();
    assert_eq!(freed, vec![(SD, sd, true), (ED, ed, true)]);
    assert!(matches!(effects[2], Effect::DropBlendState { instance } if instance == worker));
    assert_eq!(shell.liveness.status().reaped_total, 2);
    assert!(!shell.ping(worker), "the next ping must tell the worker");
}

#[test]
fn row_26_a_ping_answered_true_means_every_registration_is_held() {
    // Registered in both modules, the second after the last ping; the heartbeat stalls
    // for longer than T and less than G, then resumes.
    let mut shell = Shell::with_defaults();
    let worker = id(41);
    shell.register_built(worker, SD);
    assert!(shell.ping(worker));
    shell.run_until(at(20.0));
    shell.register_built(worker, ED);
    shell.run_until(at(20.0 + 121.0));
    assert!(!shell.tracked(worker, SD) && !shell.tracked(worker, ED));
    assert!(
        !shell.ping(worker),
        "a ping must not answer true for half an instance"
    );
}

#[test]
fn row_26_evidence_in_one_module_keeps_the_other_alive() {
    let mut shell = Shell::with_defaults();
    let worker = id(42);
    shell.register_built(worker, SD);
    shell.register_built(worker, ED);
    assert!(shell.ping(worker));
    // Only engine-driven transfers for ten reap timeouts: the server-driven entry lives.
    for second in (60..=1200).step_by(60) {
        shell.run_until(at(second as f64));
        assert!(shell.liveness.transfer(shell.now, worker, ED).is_ok());
    }
    assert!(shell.tracked(worker, SD) && shell.tracked(worker, ED));
    assert_eq!(
        shell.liveness.entry(worker, SD).unwrap().last_seen,
        at(1200.0)
    );
    assert!(shell.frees().is_empty());
    // A register of one module refreshes the other too.
    shell.run_until(at(1300.0));
    assert_eq!(
        shell.liveness.register(shell.now, worker, ED),
        Registration::Refreshed
    );
    assert_eq!(
        shell.liveness.entry(worker, SD).unwrap().last_seen,
        at(1300.0)
    );
    // Then silence: both go, at T after the register.
    shell.run_until(at(1420.0));
    assert!(shell.tracked(worker, SD) && shell.tracked(worker, ED));
    shell.run_until(at(1421.0));
    assert!(!shell.tracked(worker, SD) && !shell.tracked(worker, ED));
    assert_eq!(shell.frees().len(), 2);
}

#[test]
fn row_26_a_transfer_naming_an_unregistered_module_still_refreshes_the_instance() {
    let mut shell = Shell::with_defaults();
    let worker = id(43);
    shell.register_built(worker, SD);
    shell.run_until(at(50.0));
    assert_eq!(
        shell.liveness.transfer(shell.now, worker, ED),
        Err(TransferError::NotRegistered)
    );
    assert_eq!(
        shell.liveness.entry(worker, SD).unwrap().last_seen,
        at(50.0)
    );
    assert!(
        shell.liveness.entry(worker, ED).is_none(),
        "a transfer never inserts"
    );
}

#[test]
fn row_26_unregister_of_one_module_frees_that_module_alone() {
    let mut shell = Shell::with_defaults();
    let worker = id(44);
    let sd = shell.register_built(worker, SD);
    shell.register_built(worker, ED);
    assert!(shell.ping(worker));
    shell.run_until(at(30.0));
    assert!(shell.liveness.unregister(shell.now, worker, SD));
    shell.drain();
    assert_eq!(shell.frees().len(), 1);
    assert_eq!(shell.frees()[0].3, sd);
    assert!(shell.blend_drops(worker).is_empty());
    let view = shell.liveness.entry(worker, ED).unwrap();
    assert!(view.proven, "the instance stays proven");
    // A later registration of the freed module joins the live, proven instance.
    shell.register_built(worker, SD);
    assert!(shell.liveness.entry(worker, SD).unwrap().proven);
    assert!(shell.ping(worker));
}

#[test]
fn a_bucket_split_over_many_turns_reaps_each_instance_whole_never_early_never_late() {
    let mut shell = Shell::new(short_config());
    shell.liveness.set_turn_budget(3);
    let workers: Vec<_> = (100..400).map(id).collect();
    let alive: Vec<_> = (400..500).map(id).collect();
    for &worker in workers.iter().chain(&alive) {
        shell.register_built(worker, SD);
        shell.register_built(worker, ED);
        shell.ping(worker);
    }
    // Keep the second group alive; the first goes silent.
    for second in (10..=60).step_by(10) {
        shell.run_until(at(second as f64));
        for &worker in &alive {
            assert!(shell.ping(worker));
        }
    }
    let frees = shell.frees();
    assert_eq!(frees.len(), 2 * workers.len());
    for (when, instance, _, _, cause) in &frees {
        assert!(workers.contains(instance));
        assert!(
            *when > at(30.0) && *when <= at(31.0),
            "{instance:?} reaped at {when:?}"
        );
        assert!(matches!(cause, FreeCause::Reaped { silence, proven: true }
            if *silence > secs(30.0) && *silence <= secs(31.0)));
    }
    // Whole: each instance's effects are its two frees then its blend drop, together.
    let mut sequence = shell
        .effects
        .iter()
        .map(|(_, effect)| effect)
        .filter(|effect| !matches!(effect, Effect::StallDetected { .. }));
    while let Some(first) = sequence.next() {
        let Effect::FreeContext { instance, .. } = first else {
            panic!("a reap starts with a FreeContext: {first:?}");
        };
        assert!(
            matches!(sequence.next(), Some(Effect::FreeContext { instance: i, .. }) if i == instance)
        );
        assert!(
            matches!(sequence.next(), Some(Effect::DropBlendState { instance: i }) if i == instance)
        );
    }
    for &worker in &alive {
        assert!(shell.tracked(worker, SD) && shell.tracked(worker, ED));
    }
    assert_eq!(shell.liveness.status().tracked_entries, 2 * alive.len());
}

#[test]
fn work_left_over_asks_for_the_next_turn_at_once_and_input_is_read_before_it() {
    let mut shell = Shell::new(short_config());
    shell.liveness.set_turn_budget(1);
    for raw in 1..=10 {
        shell.register_built(id(raw), SD);
        shell.ping(id(raw));
    }
    // All ten share one bucket, due at 31 s.
    shell.run_until(at(30.0));
    let wake = shell.liveness.poll_timeout().unwrap();
    assert!(wake > at(30.0) && wake <= at(31.0));
    shell.now = wake;
    shell.liveness.handle_timeout(wake);
    shell.drain();
    assert_eq!(shell.frees().len(), 1, "one unit of budget: one reap");
    assert_eq!(
        shell.liveness.poll_timeout(),
        Some(wake),
        "asks again at once"
    );
    // A ping read before the next turn is judged in it: that instance lives.
    let survivor = (2..=10)
        .map(id)
        .find(|&worker| shell.tracked(worker, SD))
        .unwrap();
    assert!(shell.ping(survivor));
    let turns = turns_at(&mut shell, wake);
    assert_eq!(turns.len(), 9, "one instance per turn");
    assert!(shell.tracked(survivor, SD));
    assert_eq!(shell.liveness.status().reaped_total, 9);
}
