"""Shared fixtures: a fake server per test, and helpers to wait on conditions."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Callable, Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from fake_server import FakeServer  # noqa: E402


def wait_until(
    predicate: Callable[[], bool], timeout: float, what: str, poll: float = 0.02
) -> None:
    """Polls ``predicate`` until it holds; fails naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for: {what}")
        time.sleep(poll)


@pytest.fixture
def short_tmp() -> Iterator[str]:
    """A short directory path: Unix socket paths are limited to 107 bytes."""
    with tempfile.TemporaryDirectory(prefix="kvw-") as path:
        yield path


@pytest.fixture
def fake(short_tmp: str) -> Iterator[FakeServer]:
    server = FakeServer(os.path.join(short_tmp, "fake.sock")).start()
    yield server
    server.stop()
