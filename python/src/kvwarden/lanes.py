"""Background lanes: one daemon thread each, running submitted jobs in order.

Engine-neutral (no vLLM, no torch). The vLLM connector runs its loads on one lane and
its saves on another, so that neither waits on the engine's forward path and a load
never queues behind a step's saves. A job is a plain callable that reports its own
result; a job that raises is logged and the lane carries on.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable, Deque, Optional

log = logging.getLogger("kvwarden")


class Lane:
    """One thread that runs jobs in submission order; started on the first job."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: Deque[Callable[[], None]] = collections.deque()
        self._ready = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._running = False

    def submit(self, job: Callable[[], None]) -> bool:
        """Queues ``job``; False (and the job is not run) once the lane is stopping."""
        with self._ready:
            if self._stopping:
                return False
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._ready.notify()
        return True

    def idle(self) -> bool:
        """Nothing queued and nothing running."""
        with self._ready:
            return not self._jobs and not self._running

    def stop(self, timeout: float) -> bool:
        """Lets the queued jobs finish for at most ``timeout`` seconds, then stops; True
        when the thread ended in time. Jobs still queued then are not run."""
        with self._ready:
            self._stopping = True
            self._ready.notify_all()
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        with self._ready:
            self._jobs.clear()
        return not thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._jobs and not self._stopping:
                    self._ready.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._running = True
            try:
                job()
            except Exception:  # a job's bug must not stop the lane's later jobs
                log.exception("kvwarden: a job on %s failed", self.name)
            finally:
                with self._ready:
                    self._running = False
