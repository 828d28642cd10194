"""The outage log (one WARNING when the server goes, one when it is back, a reminder in
between) and the background lanes the vLLM connector moves blocks on."""

from __future__ import annotations

import logging
import threading
from typing import List

from kvwarden.lanes import Lane
from kvwarden.outage import Outage


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def outage(caplog, remind: float = 60.0):
    clock = Clock()
    logger = logging.getLogger("kvwarden.test-outage")
    caplog.set_level(logging.DEBUG, logger=logger.name)
    return Outage("/run/kv.sock", remind, clock, logger), clock


def warnings(caplog) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_row_53_an_outage_costs_one_warning_a_reminder_a_minute_and_one_when_it_ends(caplog):
    tracker, clock = outage(caplog)
    tracker.answered()  # answered while up: nothing to say
    assert warnings(caplog) == []

    for _ in range(100):  # a request every 0.5 s for 50 s
        tracker.failed("lookup", "connection refused")
        clock.now += 0.5
    assert len(warnings(caplog)) == 1
    assert "unreachable" in warnings(caplog)[0] and "lookup" in warnings(caplog)[0]
    assert tracker.is_down()

    for _ in range(40):  # 20 s more: past the minute, one reminder
        tracker.failed("ping", "timeout")
        clock.now += 0.5
    assert len(warnings(caplog)) == 2
    assert "still unreachable after 60 s" in warnings(caplog)[1]

    tracker.answered()
    tracker.answered()
    assert len(warnings(caplog)) == 3
    assert "answers again after 70.0 s" in warnings(caplog)[2]
    assert "(140 failed requests)" in warnings(caplog)[2]
    assert not tracker.is_down()
    assert tracker.unreachable_seconds() == 70.0


def test_unreachable_time_counts_the_outage_in_progress_and_the_ended_ones(caplog):
    tracker, clock = outage(caplog)
    assert tracker.unreachable_seconds() == 0.0
    tracker.failed("store_batch", "broken pipe")
    clock.now += 3
    tracker.answered()
    clock.now += 10  # up: not counted
    tracker.failed("lookup", "refused")
    clock.now += 2
    assert tracker.unreachable_seconds() == 5.0
    assert tracker.outages == 2


def test_a_lane_runs_jobs_in_order_and_survives_a_failing_job():
    lane = Lane("test-lane")
    done: List[int] = []
    gate = threading.Event()
    assert lane.idle()
    lane.submit(gate.wait)
    for i in range(5):
        lane.submit(lambda i=i: done.append(i))
        if i == 2:
            lane.submit(lambda: 1 / 0)  # logged; the later jobs still run
    assert not lane.idle()
    gate.set()
    assert lane.stop(10.0)
    assert done == [0, 1, 2, 3, 4]
    assert not lane.submit(lambda: done.append(9))  # stopped: refused, not run
    assert done == [0, 1, 2, 3, 4]


def test_stopping_a_lane_is_bounded_by_a_job_that_never_ends():
    lane = Lane("test-stuck")
    never = threading.Event()
    lane.submit(never.wait)
    lane.submit(lambda: None)
    assert not lane.stop(0.2)  # the running job holds the thread; stop gives up
    never.set()
