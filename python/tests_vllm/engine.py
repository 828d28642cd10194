"""Drives ``engine_child.py`` (a vLLM engine in its own process) from a test."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
#: Bounds on an engine's start (model load, KV cache allocation) and on one generate.
START_TIMEOUT_SECONDS = 300.0
GENERATE_TIMEOUT_SECONDS = 300.0


class Engine:
    """One engine process; ``socket_path=None``: without the kvwarden connector."""

    def __init__(
        self, model_dir: str, log_path: str, socket_path: Optional[str] = None, **extra: Any
    ) -> None:
        args = [sys.executable, os.path.join(HERE, "engine_child.py"), model_dir]
        if socket_path is not None:
            args += [socket_path, json.dumps(extra)]
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True
        )
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self._expect("KVW-READY", START_TIMEOUT_SECONDS)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("KVW-"):
                self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _expect(self, tag: str, timeout: float) -> Dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"the engine said no {tag} within {timeout} s\n{self.log_tail()}"
            ) from None
        if line is None:
            raise AssertionError(
                f"the engine exited ({self.proc.wait()}) before {tag}\n{self.log_tail()}"
            )
        name, _, body = line.partition(" ")
        assert name == tag, f"expected {tag}, got {line[:200]}"
        return json.loads(body)

    def generate(
        self, prompts: List[List[int]], max_tokens: int = 8, **options: Any
    ) -> Dict[str, Any]:
        """Greedy tokens of each prompt and the connector's counters for this generate."""
        assert self.proc.stdin is not None
        command = {"prompts": prompts, "max_tokens": max_tokens, **options}
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._expect("KVW-RESULT", GENERATE_TIMEOUT_SECONDS)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log_path, "rb") as f:
            return b"".join(f.readlines()[-lines:]).decode(errors="replace")
