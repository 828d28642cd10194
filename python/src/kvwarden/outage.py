"""What a worker says while the server is unreachable: one WARNING when it goes, one when
it is back, and a reminder at most every ``remind_after_seconds`` in between.

Engine-neutral and pure apart from logging (the clock is injectable): the
:class:`~kvwarden.worker.Worker` feeds it every failed and every answered round trip, so
a stopped server costs an engine's log three lines a minute, not one per request and
heartbeat. It also keeps the time spent unreachable, for the connector's metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

log = logging.getLogger("kvwarden")

#: Default spacing of the reminders while the server stays unreachable.
REMIND_AFTER_SECONDS = 60.0


class Outage:
    """Tracks whether ``endpoint`` answers; thread-safe."""

    def __init__(
        self,
        endpoint: str,
        remind_after_seconds: float = REMIND_AFTER_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ) -> None:
        self.endpoint = endpoint
        self.remind_after_seconds = remind_after_seconds
        self._clock = clock
        self._log = logger
        self._lock = threading.Lock()
        self._since: Optional[float] = None  # when the current outage began
        self._reminded = 0.0
        self._failures = 0  # failed round trips in the current outage
        self._closed_seconds = 0.0  # ended outages, summed
        #: Outages seen so far (each began with a WARNING).
        self.outages = 0

    def failed(self, what: str, error: object) -> None:
        """A round trip to the server failed (``what``: the request, ``error``: why)."""
        with self._lock:
            now = self._clock()
            self._failures += 1
            if self._since is None:
                self._since = self._reminded = now
                self.outages += 1
                self._log.warning(
                    "kvwarden: the server at %s is unreachable (%s failed: %s); the engine "
                    "computes without it (no hits, saves skipped) until it answers again",
                    self.endpoint,
                    what,
                    error,
                )
            elif now - self._reminded >= self.remind_after_seconds:
                self._reminded = now
                self._log.warning(
                    "kvwarden: the server at %s is still unreachable after %.0f s "
                    "(%d failed requests; latest: %s: %s)",
                    self.endpoint,
                    now - self._since,
                    self._failures,
                    what,
                    error,
                )
            else:
                self._log.debug("kvwarden: %s failed (server unreachable): %s", what, error)

    def answered(self) -> None:
        """A round trip got an answer: an outage in progress is over."""
        if self._since is None:  # the common case: no lock, nothing to say
            return
        with self._lock:
            if self._since is None:
                return
            now = self._clock()
            down = now - self._since
            self._closed_seconds += down
            self._log.warning(
                "kvwarden: the server at %s answers again after %.1f s unreachable "
                "(%d failed requests)",
                self.endpoint,
                down,
                self._failures,
            )
            self._since = None
            self._failures = 0

    def is_down(self) -> bool:
        return self._since is not None

    def unreachable_seconds(self) -> float:
        """Time spent unreachable so far, the current outage included."""
        with self._lock:
            current = 0.0 if self._since is None else self._clock() - self._since
            return self._closed_seconds + current
