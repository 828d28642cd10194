//! The worker's heartbeat machine: lazy start, fixed-delay cycle, failure and recovery,
//! stop in every phase.

use kvwarden_core::{
    Heartbeat, HeartbeatAction, HeartbeatConfig, Instant, PingReply, reap_timeout_floor_warning,
};
use std::time::Duration;

fn at(seconds: f64) -> Instant {
    Instant::ZERO + Duration::from_secs_f64(seconds)
}

fn heartbeat() -> Heartbeat {
    Heartbeat::new(HeartbeatConfig::default())
}

/// Starts at 0 s and sends the first ping.
fn pinging() -> Heartbeat {
    let mut hb = heartbeat();
    hb.start(at(0.0));
    assert_eq!(hb.handle_timeout(at(0.0)), Some(HeartbeatAction::SendPing));
    hb
}

#[test]
fn heartbeat_is_lazy_and_healthy_until_started() {
    let mut hb = heartbeat();
    assert!(!hb.is_started() && hb.is_healthy() && !hb.is_stopped());
    assert_eq!(hb.poll_timeout(), None);
    assert_eq!(hb.handle_timeout(at(1000.0)), None);
    hb.start(at(5.0));
    assert!(hb.is_started());
    assert_eq!(hb.poll_timeout(), Some(at(5.0)));
    hb.start(at(7.0)); // idempotent
    assert_eq!(hb.poll_timeout(), Some(at(5.0)));
    assert_eq!(hb.handle_timeout(at(4.9)), None);
    assert_eq!(hb.handle_timeout(at(5.0)), Some(HeartbeatAction::SendPing));
}

#[test]
fn cycle_is_fixed_delay_from_each_reply() {
    let mut hb = pinging();
    assert_eq!(
        hb.poll_timeout(),
        Some(at(10.0)),
        "in flight: the ping's deadline"
    );
    assert_eq!(hb.on_ping_reply(at(0.3), PingReply::Known), None);
    assert_eq!(hb.poll_timeout(), Some(at(10.3)));
    assert_eq!(hb.handle_timeout(at(10.2)), None);
    assert_eq!(hb.handle_timeout(at(10.3)), Some(HeartbeatAction::SendPing));
    assert_eq!(hb.on_ping_reply(at(12.0), PingReply::Known), None);
    assert_eq!(hb.poll_timeout(), Some(at(22.0)));
    assert!(hb.is_healthy());
}

#[test]
fn a_failed_ping_makes_the_worker_unhealthy_at_once() {
    let mut hb = pinging();
    assert_eq!(hb.on_ping_reply(at(0.1), PingReply::Failed), None);
    assert!(!hb.is_healthy());
    assert_eq!(hb.poll_timeout(), Some(at(10.1)));
}

#[test]
fn an_unanswered_ping_times_out_as_failed_after_one_interval() {
    let mut hb = pinging();
    assert_eq!(hb.handle_timeout(at(9.99)), None);
    assert!(hb.is_healthy());
    assert_eq!(hb.handle_timeout(at(10.0)), None);
    assert!(!hb.is_healthy());
    // The next ping is due one interval after the timeout.
    assert_eq!(hb.poll_timeout(), Some(at(20.0)));
    // A late reply to the timed-out ping is ignored.
    assert_eq!(hb.on_ping_reply(at(11.0), PingReply::Known), None);
    assert!(!hb.is_healthy());
}

#[test]
fn recovery_runs_before_health_is_set() {
    let mut hb = pinging();
    hb.on_ping_reply(at(0.1), PingReply::Failed);
    assert_eq!(hb.handle_timeout(at(10.1)), Some(HeartbeatAction::SendPing));
    assert_eq!(
        hb.on_ping_reply(at(10.2), PingReply::Known),
        Some(HeartbeatAction::Recover)
    );
    assert!(!hb.is_healthy(), "health stays cleared while recovering");
    assert_eq!(hb.poll_timeout(), None, "no ping while a recovery runs");
    hb.on_recover_done(at(10.5), true);
    assert!(hb.is_healthy());
    assert_eq!(hb.poll_timeout(), Some(at(20.5)));
}

#[test]
fn a_failed_recovery_is_retried_after_the_next_good_ping() {
    let mut hb = pinging();
    assert_eq!(
        hb.on_ping_reply(at(0.1), PingReply::Unknown),
        Some(HeartbeatAction::Recover)
    );
    hb.on_recover_done(at(1.0), false);
    assert!(!hb.is_healthy());
    assert_eq!(hb.poll_timeout(), Some(at(11.0)));
    assert_eq!(hb.handle_timeout(at(11.0)), Some(HeartbeatAction::SendPing));
    assert_eq!(
        hb.on_ping_reply(at(11.1), PingReply::Known),
        Some(HeartbeatAction::Recover)
    );
    hb.on_recover_done(at(11.2), true);
    assert!(hb.is_healthy());
}

#[test]
fn unknown_triggers_recovery_even_when_healthy() {
    let mut hb = pinging();
    assert!(hb.is_healthy());
    assert_eq!(
        hb.on_ping_reply(at(0.2), PingReply::Unknown),
        Some(HeartbeatAction::Recover)
    );
    assert!(!hb.is_healthy());
}

#[test]
fn a_reply_with_no_ping_in_flight_is_ignored() {
    let mut hb = heartbeat();
    assert_eq!(hb.on_ping_reply(at(1.0), PingReply::Unknown), None);
    assert!(hb.is_healthy());
    hb.on_recover_done(at(1.0), false);
    assert!(hb.is_healthy());
    let mut hb = pinging();
    hb.on_ping_reply(at(0.1), PingReply::Known);
    assert_eq!(
        hb.on_ping_reply(at(0.2), PingReply::Failed),
        None,
        "duplicate reply"
    );
    assert!(hb.is_healthy());
}

#[test]
fn stop_in_every_phase_silences_the_machine_for_good() {
    type Phase = (&'static str, fn() -> Heartbeat);
    let phases: Vec<Phase> = vec![
        ("not started", heartbeat),
        ("waiting", || {
            let mut hb = pinging();
            hb.on_ping_reply(at(0.1), PingReply::Known);
            hb
        }),
        ("in flight", pinging),
        ("recovering", || {
            let mut hb = pinging();
            hb.on_ping_reply(at(0.1), PingReply::Unknown);
            hb
        }),
        ("unhealthy", || {
            let mut hb = pinging();
            hb.on_ping_reply(at(0.1), PingReply::Failed);
            hb
        }),
    ];
    for (phase, make) in phases {
        let mut hb = make();
        let health = hb.is_healthy();
        hb.stop();
        assert!(hb.is_stopped(), "{phase}");
        assert_eq!(hb.poll_timeout(), None, "{phase}");
        hb.start(at(50.0));
        for t in [0.0, 10.0, 100.0, 1e6] {
            assert_eq!(hb.handle_timeout(at(t)), None, "{phase}");
        }
        for reply in [PingReply::Known, PingReply::Unknown, PingReply::Failed] {
            assert_eq!(hb.on_ping_reply(at(200.0), reply), None, "{phase}");
        }
        hb.on_recover_done(at(300.0), true);
        hb.on_recover_done(at(300.0), false);
        assert_eq!(
            hb.is_healthy(),
            health,
            "{phase}: health changed after stop"
        );
        assert_eq!(hb.poll_timeout(), None, "{phase}");
    }
}

#[test]
fn floor_warning_when_three_intervals_exceed_thirty_seconds() {
    assert_eq!(reap_timeout_floor_warning(Duration::from_secs(10)), None);
    assert_eq!(reap_timeout_floor_warning(Duration::from_secs(1)), None);
    let warning = reap_timeout_floor_warning(Duration::from_secs(11)).expect("33 s > 30 s");
    assert!(
        warning.contains("30 s") && warning.contains("11.0"),
        "{warning}"
    );
    assert!(reap_timeout_floor_warning(Duration::from_millis(10_001)).is_some());
}

/// The one recovery rule both clients follow: a transfer answered `not_registered`
/// clears health and makes the recovery due at once, without a ping first; health is
/// back only once it succeeded.
#[test]
fn a_transfer_answered_not_registered_recovers_at_once_without_a_ping() {
    let mut hb = pinging();
    assert_eq!(hb.on_ping_reply(at(0.1), PingReply::Known), None);
    assert_eq!(
        hb.poll_timeout(),
        Some(at(10.1)),
        "the control: next ping in 10 s"
    );
    hb.on_not_registered(at(2.0));
    assert!(!hb.is_healthy());
    assert_eq!(
        hb.poll_timeout(),
        Some(at(2.0)),
        "due at once, not at the next ping"
    );
    assert_eq!(hb.handle_timeout(at(2.0)), Some(HeartbeatAction::Recover));
    assert_eq!(hb.poll_timeout(), None, "running");
    hb.on_not_registered(at(2.5)); // another transfer answered meanwhile: one recovery
    assert_eq!(hb.handle_timeout(at(2.5)), None);
    hb.on_recover_done(at(3.0), true);
    assert!(hb.is_healthy());
    assert_eq!(hb.poll_timeout(), Some(at(13.0)));
}

#[test]
fn not_registered_during_a_ping_recovers_through_its_reply_and_is_ignored_when_stopped() {
    let mut hb = pinging();
    hb.on_not_registered(at(1.0));
    assert!(!hb.is_healthy(), "health clears at once");
    assert_eq!(
        hb.poll_timeout(),
        Some(at(10.0)),
        "the ping in flight keeps its deadline"
    );
    assert_eq!(
        hb.on_ping_reply(at(1.5), PingReply::Known),
        Some(HeartbeatAction::Recover),
        "true while unhealthy asks for the recovery"
    );
    // Before start and after stop it changes nothing.
    let mut idle = heartbeat();
    idle.on_not_registered(at(0.0));
    assert!(idle.is_healthy() && idle.poll_timeout().is_none());
    idle.start(at(0.0));
    idle.stop();
    idle.on_not_registered(at(1.0));
    assert!(idle.is_healthy());
    assert_eq!(idle.handle_timeout(at(1.0)), None);
}
