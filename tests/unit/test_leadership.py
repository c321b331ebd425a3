"""The Lease election (leadership.py) on a fake clock and an in-memory Lease: client-go's rules."""

from __future__ import annotations

import datetime
from types import SimpleNamespace
from typing import Any

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from binbatch_operator.leadership import LEASE_DURATION, RENEW_DEADLINE, RETRY_PERIOD, LeaseElector, holder_priority, micro_time


def micro(text: str) -> datetime.datetime:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.UTC)


class FakeLeases:
    """The three Lease calls the elector makes, on one in-memory Lease with a resourceVersion.

    ``failing`` makes writes fail; each call takes ``delay`` seconds of ``clock`` and times out
    (urllib3's error) if that is over its ``_request_timeout``; ``calls`` counts them.
    """

    def __init__(self, clock: list[float] | None = None, held_by: str | None = None) -> None:
        self.spec: dict[str, Any] | None = None
        self.version = 0
        self.failing = False
        self.clock, self.delay, self.calls = clock or [0.0], 0.0, 0
        if held_by:  # renewed just now by another replica
            now = micro_time(datetime.datetime.now(datetime.UTC))
            self.spec = {"holderIdentity": held_by, "renewTime": now, "acquireTime": now, "leaseTransitions": 0,
                         "leaseDurationSeconds": LEASE_DURATION}  # fmt: skip

    def read_namespaced_lease(self, name: str, namespace: str, _request_timeout: float) -> Any:
        self._take(_request_timeout)
        if self.spec is None:
            raise ApiException(status=404)
        s = self.spec  # the client deserializes MicroTimes to datetimes
        return SimpleNamespace(metadata=self._meta(), spec=SimpleNamespace(
            holder_identity=s["holderIdentity"], renew_time=micro(s["renewTime"]), acquire_time=micro(s["acquireTime"]),
            lease_transitions=s["leaseTransitions"], lease_duration_seconds=s["leaseDurationSeconds"]))  # fmt: skip

    def create_namespaced_lease(self, namespace: str, body: dict[str, Any], _request_timeout: float) -> Any:
        self._take(_request_timeout)
        return self._write(body["spec"])

    def patch_namespaced_lease(self, name: str, namespace: str, patch: Any, _request_timeout: float,
                               _content_type: str) -> Any:  # fmt: skip
        self._take(_request_timeout)
        if patch["metadata"]["resourceVersion"] != str(self.version):
            raise ApiException(status=409, reason="Conflict")
        return self._write({**(self.spec or {}), **patch["spec"]})  # a merge patch

    def _take(self, timeout: float) -> None:
        self.calls += 1
        self.clock[0] += min(self.delay, timeout)
        if self.delay > timeout:
            raise urllib3.exceptions.ReadTimeoutError(None, "/leases", "Read timed out.")

    def _write(self, spec: dict[str, Any]) -> Any:
        if self.failing:
            raise ApiException(status=503, reason="Service Unavailable")
        self.spec, self.version = dict(spec), self.version + 1
        return SimpleNamespace(metadata=self._meta())

    def _meta(self) -> Any:
        return SimpleNamespace(resource_version=str(self.version))


class Candidate:
    def __init__(self, leases: FakeLeases, identity: str, clock: list[float]) -> None:
        self.led: list[int] = []
        self.lost: list[str] = []
        self.elector = LeaseElector(leases, "binbatch", "ns", identity, self.led.append, self.lost.append,
                                    clock=lambda: clock[0])  # fmt: skip


@pytest.fixture
def world() -> tuple[FakeLeases, list[float]]:
    clock = [1000.0]
    return FakeLeases(clock), clock


def test_the_first_candidate_takes_the_lease_and_a_second_waits(world):
    leases, clock = world
    a, b = Candidate(leases, "a", clock), Candidate(leases, "b", clock)
    assert a.elector.step() and b.elector.step()
    assert a.led == [0] and b.led == [] and leases.spec["holderIdentity"] == "a"
    for _ in range(20):  # a renews every RETRY_PERIOD: b never takes over
        clock[0] += RETRY_PERIOD
        assert a.elector.step() and b.elector.step()
    assert b.led == [] and a.lost == []


def test_a_silent_holder_is_replaced_once_its_record_stood_still_for_the_lease_duration(world):
    leases, clock = world
    a, b = Candidate(leases, "a", clock), Candidate(leases, "b", clock)
    a.elector.step()
    b.elector.step()  # b sees a's record now
    clock[0] += LEASE_DURATION - 0.1
    b.elector.step()
    assert b.led == []
    clock[0] += 0.1
    b.elector.step()
    assert b.led == [1] and leases.spec["holderIdentity"] == "b"
    assert holder_priority(1) > holder_priority(0) > 0  # the new holder outranks the old in kopf's peering


def test_a_holder_that_cannot_renew_stops_before_anyone_may_take_over(world):
    """The split brain of issue 23: a leader whose keep-alives were late went on acting while the
    follower took over. Here a holder unable to renew gives up at RENEW_DEADLINE after its last
    renewal, while a follower needs the record unchanged for LEASE_DURATION."""
    leases, clock = world
    a, b = Candidate(leases, "a", clock), Candidate(leases, "b", clock)
    a.elector.step()
    leases.failing = True
    renewed, lost_at, taken_at = clock[0], None, None
    for _ in range(int(4 * LEASE_DURATION / 0.5)):
        clock[0] += 0.5
        if lost_at is None and not a.elector.step():
            lost_at = clock[0]
        b.elector.step()
        if b.led:
            taken_at = clock[0]
            break
        leases.failing = lost_at is None  # the API answers again once a has stopped: b may acquire
    assert a.lost and "could not renew" in a.lost[0], "the holder went on as if it led"
    assert lost_at - renewed <= RENEW_DEADLINE + 0.5
    assert lost_at < taken_at and taken_at - renewed >= LEASE_DURATION


def test_a_restarted_replica_waits_for_the_lease_its_former_run_held(world):
    """A container restarts under the same pod name: its new run must not renew the old run's claim at once."""
    leases, clock = world
    Candidate(leases, "a", clock).elector.step()
    again = Candidate(leases, "a", clock)
    again.elector.step()
    assert again.led == []
    clock[0] += LEASE_DURATION
    again.elector.step()
    assert again.led == [1]


def test_the_holder_renews_with_one_request_and_a_slow_one_still_counts(world):
    """At 1,000 policies a leader's start kept the API server busy: a Lease GET took 1.4 s and the
    holder, renewing by a GET and a patch each cut off at RETRY_PERIOD, ran out of time and exited."""
    leases, clock = world
    a = Candidate(leases, "a", clock)
    a.elector.step()
    leases.calls = 0
    clock[0] += RETRY_PERIOD
    assert a.elector.step()
    assert leases.calls == 1  # a conditional patch, no read
    leases.delay = RETRY_PERIOD + 1.0  # slower than a retry period, within the renew deadline
    for _ in range(5):
        assert a.elector.step()
    assert a.lost == [] and leases.spec["holderIdentity"] == "a" and leases.calls == 6


def test_a_holder_whose_lease_another_replica_wrote_reads_it_and_stops_renewing(world):
    leases, clock = world
    a = Candidate(leases, "a", clock)
    a.elector.step()
    leases.spec["holderIdentity"], leases.version = "b", leases.version + 1  # b took it (a's clock stood still)
    assert a.elector.step()  # the conditional patch conflicts; a reads b's claim and leaves it
    assert leases.spec["holderIdentity"] == "b"
    clock[0] += RENEW_DEADLINE
    assert not a.elector.step() and a.lost
