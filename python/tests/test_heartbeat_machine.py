"""The Python heartbeat machine has exactly the core's semantics (core/src/heartbeat.rs).

Virtual time: no sleeps, every input carries ``now``.
"""

from __future__ import annotations

import pytest

from kvwarden.heartbeat import (
    Heartbeat,
    HeartbeatAction,
    PingReply,
    reap_timeout_floor_warning,
)

INTERVAL = 10.0


def started(now: float = 0.0) -> Heartbeat:
    hb = Heartbeat(INTERVAL)
    hb.start(now)
    return hb


def test_new_heartbeat_is_healthy_and_not_started() -> None:
    hb = Heartbeat(INTERVAL)
    assert hb.is_healthy()
    assert not hb.is_started()
    assert hb.poll_timeout() is None
    assert hb.handle_timeout(1e9) is None


def test_start_is_lazy_idempotent_and_pings_at_once() -> None:
    hb = started(5.0)
    assert hb.poll_timeout() == 5.0
    hb.start(100.0)  # idempotent: the due time does not move
    assert hb.poll_timeout() == 5.0
    assert hb.handle_timeout(4.9) is None
    assert hb.handle_timeout(5.0) is HeartbeatAction.SEND_PING


def test_known_reply_keeps_health_and_next_ping_is_interval_after_the_reply() -> None:
    hb = started()
    assert hb.handle_timeout(0.0) is HeartbeatAction.SEND_PING
    assert hb.poll_timeout() == INTERVAL  # the in-flight deadline
    assert hb.on_ping_reply(3.0, PingReply.KNOWN) is None
    assert hb.is_healthy()
    assert hb.poll_timeout() == 3.0 + INTERVAL  # fixed delay from the reply


def test_one_failed_ping_clears_health_without_recovery() -> None:
    hb = started()
    hb.handle_timeout(0.0)
    assert hb.on_ping_reply(1.0, PingReply.FAILED) is None
    assert not hb.is_healthy()
    assert hb.poll_timeout() == 1.0 + INTERVAL


def test_unanswered_ping_fails_after_one_interval() -> None:
    hb = started()
    hb.handle_timeout(0.0)
    assert hb.handle_timeout(INTERVAL - 0.001) is None
    assert hb.is_healthy()
    assert hb.handle_timeout(INTERVAL) is None
    assert not hb.is_healthy()
    assert hb.poll_timeout() == 2 * INTERVAL


def test_good_ping_after_failure_recovers_before_health() -> None:
    hb = started()
    hb.handle_timeout(0.0)
    hb.on_ping_reply(0.0, PingReply.FAILED)
    hb.handle_timeout(INTERVAL)
    assert hb.on_ping_reply(INTERVAL, PingReply.KNOWN) is HeartbeatAction.RECOVER
    assert not hb.is_healthy(), "health stays cleared while the recovery runs"
    assert hb.poll_timeout() is None, "no ping while recovering"
    hb.on_recover_done(INTERVAL + 2.0, True)
    assert hb.is_healthy()
    assert hb.poll_timeout() == INTERVAL + 2.0 + INTERVAL  # fixed delay from the recovery's end


def test_unknown_reply_clears_health_and_recovers() -> None:
    hb = started()
    hb.handle_timeout(0.0)
    assert hb.on_ping_reply(0.0, PingReply.UNKNOWN) is HeartbeatAction.RECOVER
    assert not hb.is_healthy()


def test_failed_recovery_is_retried_after_the_next_good_ping() -> None:
    hb = started()
    hb.handle_timeout(0.0)
    hb.on_ping_reply(0.0, PingReply.UNKNOWN)
    hb.on_recover_done(1.0, False)
    assert not hb.is_healthy()
    assert hb.poll_timeout() == 1.0 + INTERVAL
    assert hb.handle_timeout(1.0 + INTERVAL) is HeartbeatAction.SEND_PING
    assert hb.on_ping_reply(1.0 + INTERVAL, PingReply.KNOWN) is HeartbeatAction.RECOVER
    hb.on_recover_done(2.0 + INTERVAL, True)
    assert hb.is_healthy()


def test_failed_ping_while_unhealthy_does_not_recover() -> None:
    hb = started()
    hb.handle_timeout(0.0)
    hb.on_ping_reply(0.0, PingReply.FAILED)
    hb.handle_timeout(INTERVAL)
    assert hb.on_ping_reply(INTERVAL, PingReply.FAILED) is None
    assert not hb.is_healthy()


def test_late_or_duplicate_replies_are_ignored() -> None:
    hb = started()
    assert hb.on_ping_reply(0.0, PingReply.UNKNOWN) is None  # nothing in flight
    hb.handle_timeout(0.0)
    hb.on_ping_reply(0.0, PingReply.KNOWN)
    assert hb.on_ping_reply(0.1, PingReply.UNKNOWN) is None
    assert hb.is_healthy()
    hb.on_recover_done(0.2, False)  # no recovery asked: ignored
    assert hb.is_healthy()


def test_stop_freezes_actions_and_health() -> None:
    hb = started()
    hb.handle_timeout(0.0)
    hb.stop()
    assert hb.is_stopped()
    assert hb.on_ping_reply(0.0, PingReply.UNKNOWN) is None
    assert hb.is_healthy()
    assert hb.handle_timeout(1e9) is None
    assert hb.poll_timeout() is None
    hb.start(0.0)
    assert hb.is_stopped()


def test_stop_during_recovery_ignores_its_outcome() -> None:
    hb = started()
    hb.handle_timeout(0.0)
    hb.on_ping_reply(0.0, PingReply.UNKNOWN)
    hb.stop()
    hb.on_recover_done(1.0, True)
    assert not hb.is_healthy(), "a cycle still running never changes health after stop"


def test_not_registered_transfer_leads_to_the_same_recovery() -> None:
    hb = started()
    hb.handle_timeout(0.0)
    hb.on_ping_reply(0.0, PingReply.KNOWN)  # next ping due at INTERVAL
    assert hb.poll_timeout() == INTERVAL, "the control: the next ping, one interval on"
    hb.on_not_registered(2.0)
    assert not hb.is_healthy()
    assert hb.poll_timeout() == 2.0, "the recovery is due at once"
    assert hb.handle_timeout(2.0) is HeartbeatAction.RECOVER, "no ping first"
    assert hb.is_recovering() and hb.poll_timeout() is None
    hb.on_not_registered(2.5)  # another transfer answered meanwhile: one recovery
    assert hb.handle_timeout(2.5) is None
    hb.on_recover_done(3.0, True)
    assert hb.is_healthy()
    assert hb.poll_timeout() == 3.0 + INTERVAL


def test_not_registered_during_a_ping_recovers_through_its_reply() -> None:
    hb = started()
    assert hb.handle_timeout(0.0) is HeartbeatAction.SEND_PING
    hb.on_not_registered(1.0)
    assert not hb.is_healthy(), "health clears at once"
    assert hb.poll_timeout() == INTERVAL, "the ping in flight keeps its deadline"
    assert hb.on_ping_reply(1.5, PingReply.KNOWN) is HeartbeatAction.RECOVER


def test_not_registered_is_ignored_before_start_and_after_stop() -> None:
    hb = Heartbeat(INTERVAL)
    hb.on_not_registered(0.0)
    assert hb.is_healthy()
    hb.start(0.0)
    hb.stop()
    hb.on_not_registered(0.0)
    assert hb.is_healthy()


def test_floor_warning_only_above_ten_seconds() -> None:
    assert reap_timeout_floor_warning(10.0) is None
    assert reap_timeout_floor_warning(0.5) is None
    warning = reap_timeout_floor_warning(11.0)
    assert warning is not None and "33.0 s" in warning and "30 s" in warning


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_interval_is_rejected_naming_the_value(bad: float) -> None:
    with pytest.raises(ValueError, match="heartbeat interval"):
        Heartbeat(bad)
