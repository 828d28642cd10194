"""Runs the real ``kvwarden`` binary for tests: start, status, signal, restart.

The binary is ``$KVWARDEN_BIN``, else ``target/debug/kvwarden`` at the repository root
(``python/ci.sh`` builds it there when it is missing).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from kvwarden.wire import Connection

REPO_ROOT = Path(__file__).resolve().parents[2]


def find_binary() -> Optional[str]:
    """The server binary to test, or None when there is none."""
    explicit = os.environ.get("KVWARDEN_BIN")
    if explicit:
        return explicit
    default = REPO_ROOT / "target" / "debug" / "kvwarden"
    return str(default) if default.exists() else None


class RealServer:
    """One ``kvwarden serve`` process on a private socket, with short test timeouts."""

    def __init__(
        self,
        binary: str,
        socket_path: str,
        log_path: str,
        reap_timeout_seconds: float = 2.0,
        registration_grace_seconds: float = 4.0,
        resolution_seconds: float = 0.1,
        extra_args: Sequence[str] = (),
        slot_bytes: str = "1M",
        l1_bytes: str = "64M",
    ) -> None:
        self.binary = binary
        self.socket_path = socket_path
        self.log_path = log_path
        self.args = [
            binary,
            "serve",
            "--socket",
            socket_path,
            "--http",
            "off",
            "--worker-reap-timeout-seconds",
            str(reap_timeout_seconds),
            "--worker-registration-grace-seconds",
            str(registration_grace_seconds),
            "--resolution-seconds",
            str(resolution_seconds),
            "--l1-bytes",
            l1_bytes,
            "--slot-bytes",
            slot_bytes,
            "--allow-short-timeouts",
            *extra_args,
        ]
        self.proc: Optional[subprocess.Popen] = None
        self._probe: Optional[Connection] = None
        #: Why the test makes this server answer pings ``false`` on purpose (a reap, a
        #: restart, an unknown id); None: any such answer fails the test at teardown.
        self.pings_answered_false_expected: Optional[str] = None

    def start(self, timeout: float = 20.0) -> "RealServer":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"kvwarden exited with {self.proc.returncode} at start-up: "
                    f"{' '.join(self.args)}\n{self.log_tail()}"
                )
            if os.path.exists(self.socket_path):
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(self.socket_path)
                    break
                except OSError:
                    pass
                finally:
                    probe.close()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"kvwarden did not listen on {self.socket_path} within {timeout} s\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.02)
        self._probe = Connection(self.socket_path, "kvwarden-python-tests")
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> Optional[int]:
        """Signals the server and waits for it to exit; returns its exit code."""
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired as error:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(
                f"kvwarden did not exit within {timeout} s of signal {sig}\n{self.log_tail()}"
            ) from error

    def restart(self, sig: int = signal.SIGTERM) -> None:
        self.stop(sig)
        self.start()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def status(self) -> Dict[str, Any]:
        """The status map, asked over a connection of the test process (whose pings
        are never sent: probing must not refresh anyone's liveness)."""
        assert self._probe is not None
        value, _ = self._probe.request("status", [], timeout=10.0)
        return value

    def request(self, op: str, args: List[Any]) -> Any:
        assert self._probe is not None
        return self._probe.request(op, args, timeout=10.0)[0]

    def check_no_ping_answered_false(self) -> None:
        """Fails when this server answered a ping ``false`` and the test declared no
        reason (``pings_answered_false_expected``): a live worker told that its instance
        is not held is the failure kvwarden exists to prevent."""
        if self.pings_answered_false_expected is not None:
            return
        if self.proc is None or self.proc.poll() is not None or self._probe is None:
            return
        self.proc.send_signal(signal.SIGCONT)  # a test may have paused it
        liveness = self.status()["worker_liveness"]
        answered_false = liveness["pings_answered_false_total"]
        assert answered_false == 0, (
            f"the server answered {answered_false} of {liveness['pings_total']} pings false "
            "in a test that declared no reap, restart or unknown id "
            "(pings_answered_false_expected): a live worker was told its instance is not "
            f"held\n{self.log_tail()}"
        )

    def entries(self, instance_id: int) -> List[Dict[str, Any]]:
        """The status entries (one per module) of one instance."""
        return [e for e in self.status()["instances"] if e["instance_id"] == instance_id]

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-lines:]).decode(errors="replace")
        except OSError:
            return "(no log)"
