"""The worker's side of liveness: when to ping, what a reply means, when to recover.

A line-for-line port of the core's ``Heartbeat`` (``core/src/heartbeat.rs``), so the
Python worker has exactly the semantics the spec fixes. Sans-IO: it never reads a clock
and never touches a socket; :class:`kvwarden.worker.Worker` drives it from a thread,
feeding ``now`` from ``time.monotonic()``.

Fixed-delay cycle: ping; on the reply (or after ``interval`` without one) act; the next
ping is due ``interval`` after the reply, or after the recovery finished. Health is set
only after a recovery (re-registering everything under the same id) succeeded, so a
worker never believes in state the server no longer holds.

The one recovery rule both clients follow (the core's ``on_not_registered``): a ping
answered false, a ping answered true while unhealthy, and a transfer answered
``not_registered`` lead to the same recovery, run by the heartbeat thread. A transfer
answered ``not_registered`` clears health at once and makes the recovery due at once,
without a ping first (the answer is the evidence; a ping would only be answered false);
a ping in flight leads there by its reply. The transfer itself reports failure.
"""

from __future__ import annotations

import enum
import math
from typing import Optional

#: The server's minimum reap timeout (``REAP_TIMEOUT_FLOOR`` in the core), in seconds.
REAP_TIMEOUT_FLOOR_SECONDS = 30.0

#: The default heartbeat interval, in seconds (``HeartbeatConfig::default``).
DEFAULT_INTERVAL_SECONDS = 10.0


class HeartbeatAction(enum.Enum):
    """What the driver must do now."""

    #: Send ``ping [instance_id]``.
    SEND_PING = "send_ping"
    #: Re-register every registration with the same instance id, then call
    #: :meth:`Heartbeat.on_recover_done`.
    RECOVER = "recover"


class PingReply(enum.Enum):
    """How the server answered a ping."""

    #: The server answered true.
    KNOWN = "known"
    #: The server answered false: it does not hold this instance (reaped, restarted).
    UNKNOWN = "unknown"
    #: Error reply, timeout, disconnect.
    FAILED = "failed"


class _Phase(enum.Enum):
    NOT_STARTED = "not_started"
    WAITING = "waiting"  # the next ping is due at `_at`
    IN_FLIGHT = "in_flight"  # a ping was sent; it counts as failed at `_at`
    RECOVER_DUE = "recover_due"  # a recovery is due at `_at` (not_registered)
    RECOVERING = "recovering"
    STOPPED = "stopped"


def validate_interval(interval_seconds: float) -> float:
    """Returns the interval as a float, or raises naming the bad value and the fix."""
    value = float(interval_seconds)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(
            f"heartbeat interval must be a finite number of seconds > 0, got "
            f"{interval_seconds!r}; the default is {DEFAULT_INTERVAL_SECONDS} s"
        )
    return value


class Heartbeat:
    """The worker's heartbeat machine: not started and healthy when created.

    Time is a float in seconds on any monotonic clock. Not thread-safe: the driver
    serializes calls (the worker holds one lock around every call).
    """

    def __init__(self, interval_seconds: float = DEFAULT_INTERVAL_SECONDS) -> None:
        self.interval = validate_interval(interval_seconds)
        self._phase = _Phase.NOT_STARTED
        self._at = 0.0
        self._healthy = True

    def start(self, now: float) -> None:
        """Lazy start (first store/retrieve). Idempotent. The first ping is due at ``now``."""
        if self._phase is _Phase.NOT_STARTED:
            self._phase = _Phase.WAITING
            self._at = now

    def is_started(self) -> bool:
        """Whether ``start`` was called (or ``stop``)."""
        return self._phase is not _Phase.NOT_STARTED

    def is_healthy(self) -> bool:
        """False from a failed ping until a recovery succeeds."""
        return self._healthy

    def is_stopped(self) -> bool:
        """Whether ``stop`` was called."""
        return self._phase is _Phase.STOPPED

    def is_recovering(self) -> bool:
        """Whether a recovery was asked for and not reported yet."""
        return self._phase is _Phase.RECOVERING

    def poll_timeout(self) -> Optional[float]:
        """Next ping due, the in-flight ping's deadline, or when a recovery is due; None
        when not started, stopped, or while a recovery is running."""
        if self._phase in (_Phase.WAITING, _Phase.IN_FLIGHT, _Phase.RECOVER_DUE):
            return self._at
        return None

    def handle_timeout(self, now: float) -> Optional[HeartbeatAction]:
        """``SEND_PING`` when a ping is due, ``RECOVER`` when a recovery is. A ping
        unanswered for ``interval`` is Failed."""
        if self._phase is _Phase.RECOVER_DUE and now >= self._at:
            self._phase = _Phase.RECOVERING
            return HeartbeatAction.RECOVER
        if self._phase is _Phase.WAITING and now >= self._at:
            self._phase = _Phase.IN_FLIGHT
            self._at = now + self.interval
            return HeartbeatAction.SEND_PING
        if self._phase is _Phase.IN_FLIGHT and now >= self._at:
            return self.on_ping_reply(now, PingReply.FAILED)
        return None

    def on_ping_reply(self, now: float, reply: PingReply) -> Optional[HeartbeatAction]:
        """Failed → unhealthy at once. Known while unhealthy → ``RECOVER`` (health stays
        cleared until the recovery succeeds). Unknown → unhealthy and ``RECOVER``.
        A reply while no ping is in flight (late, duplicated, after stop) is ignored."""
        if self._phase is not _Phase.IN_FLIGHT:
            return None
        if reply is PingReply.KNOWN and self._healthy:
            self._phase = _Phase.WAITING
            self._at = now + self.interval
            return None
        if reply is PingReply.FAILED:
            self._healthy = False
            self._phase = _Phase.WAITING
            self._at = now + self.interval
            return None
        self._healthy = False
        self._phase = _Phase.RECOVERING
        return HeartbeatAction.RECOVER

    def on_recover_done(self, now: float, ok: bool) -> None:
        """True → healthy. False → stays unhealthy; recovery is asked again after the
        next successful ping. Ignored unless a recovery was asked for (and after stop)."""
        if self._phase is not _Phase.RECOVERING:
            return
        if ok:
            self._healthy = True
        self._phase = _Phase.WAITING
        self._at = now + self.interval

    def on_not_registered(self, now: float) -> None:
        """A transfer was answered ``not_registered``: health clears at once and the
        recovery is due at ``now`` (no ping first). A ping in flight leads there by its
        reply; a recovery already running restores health when it succeeds. Ignored
        before start and after stop."""
        if self._phase in (_Phase.NOT_STARTED, _Phase.STOPPED):
            return
        self._healthy = False
        if self._phase is _Phase.WAITING:
            self._phase = _Phase.RECOVER_DUE
            self._at = now

    def stop(self) -> None:
        """After stop no action is ever returned and health never changes again."""
        self._phase = _Phase.STOPPED


def reap_timeout_floor_warning(interval_seconds: float) -> Optional[str]:
    """A warning when 3 × interval exceeds the server's 30 s reap-timeout floor."""
    three_intervals = 3.0 * float(interval_seconds)
    if three_intervals <= REAP_TIMEOUT_FLOOR_SECONDS:
        return None
    return (
        f"heartbeat interval {float(interval_seconds)} s: 3 × interval = "
        f"{three_intervals} s exceeds the server's {REAP_TIMEOUT_FLOOR_SECONDS:g} s "
        f"reap-timeout floor; a server configured at the floor could reap this worker "
        f"between two pings. Use an interval of at most "
        f"{REAP_TIMEOUT_FLOOR_SECONDS / 3:g} s, or make sure the server's reap timeout "
        f"is at least {three_intervals} s"
    )
