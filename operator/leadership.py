"""Which replica handles the policies: a coordination.k8s.io Lease, renewed from a thread of its own.

kopf's peering alone elected by keep-alives that the event loop sends, and its
leader never stops on its own: at 1,000 policies a busy loop sent them late, the
follower took the leader for dead and resumed while the leader went on acting.
Here the choice follows client-go's leader election over a Lease:

- every replica runs a ``LeaseElector`` in a thread with its own API client and
  a timeout on each request, so a busy event loop delays no renewal;
- the holder renews with one request, a patch conditional on the resourceVersion
  it last wrote, which may take until its renew deadline: at 1,000 policies a
  leader's start keeps a shared API server busy for a while (a Lease GET took
  1.4 s), and two round trips capped at ``RETRY_PERIOD`` each ran out of time;
- a follower takes the Lease only once its holder's record has stayed unchanged
  for ``LEASE_DURATION`` by the follower's own clock;
- a holder that has not renewed within ``RENEW_DEADLINE`` of its last renewal
  gives up (the operator exits, as controller-runtime's managers do, and the pod
  restarts as a follower): it is gone before any follower may take over.

kopf still pauses the replicas through its peering object, which a Lease now
drives: a permanent entry ``LEASE_GATE`` at priority 0 outranks every replica
(their priorities are negative) except the holder, whose priority becomes
``1 + leaseTransitions``: above the gate and above any former holder's.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

LEASE_DURATION = 10.0  # s: a holder silent this long (by a follower's clock) is replaced; client-go's default is 15
RENEW_DEADLINE = 7.0  # s: a holder unable to renew this long stops, 3 s before anyone may take over
RETRY_PERIOD = 2.0  # s: between renewals and followers' checks; also the longest a request may take
LEASE_GATE = "held-by-lease"  # the peering entry that pauses every replica not holding the Lease

log = logging.getLogger(__name__)


def gate_entry() -> dict[str, Any]:
    """The permanent peering entry (kopf's keep-alive format) that outranks every replica but the holder."""
    now = datetime.datetime.now(datetime.UTC).isoformat()
    return {"priority": 0, "lifetime": 10**9, "lastseen": now}


def holder_priority(transitions: int) -> int:
    """The holder's kopf priority: above the gate, and above every former holder's (they took fewer transitions)."""
    return 1 + transitions


class LeaseElector:
    """Acquire and renew the Lease ``namespace/name`` as ``identity``; call ``on_leading(transitions)`` once
    this replica holds it and ``on_lost(reason)`` when it could not renew in time (which must stop acting).

    ``clock`` is monotonic seconds and ``wait(seconds)`` sleeps unless stopped (returns True when stopped):
    both are injected so tests drive time.
    """

    def __init__(
        self, api: kubernetes.client.CoordinationV1Api, name: str, namespace: str, identity: str,
        on_leading: Callable[[int], None], on_lost: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic, wait: Callable[[float], bool] | None = None,
    ) -> None:  # fmt: skip
        self._api, self.name, self.namespace, self.identity = api, name, namespace, identity
        self._on_leading, self._on_lost, self._clock = on_leading, on_lost, clock
        self._stopped = threading.Event()
        self._wait = wait or self._stopped.wait
        self.leading = False
        self._renewed = 0.0  # clock() when the last successful renewal started
        self._held: tuple[str, int] | None = None  # the resourceVersion and leaseTransitions this replica last wrote
        self._seen: tuple[Any, ...] | None = None  # the holder's record as last seen, and since when
        self._seen_at = 0.0

    def start(self) -> None:
        threading.Thread(target=self.run, name="lease elector", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        while not self._stopped.is_set():
            if not self.step():
                return
            if self._wait(self._pause()):
                return

    def _pause(self) -> float:
        return min(RETRY_PERIOD, self._left()) if self.leading else RETRY_PERIOD

    def _left(self) -> float:
        """Seconds until the holder must stop (its renew deadline)."""
        return max(0.0, self._renewed + RENEW_DEADLINE - self._clock())

    def step(self) -> bool:
        """One attempt to acquire or renew; False once leadership is lost (``on_lost`` was called)."""
        started = self._clock()
        timeout = max(0.1, self._left()) if self.leading else RETRY_PERIOD
        try:
            transitions = self._try_acquire_or_renew(started, timeout)
        except Exception as exc:  # noqa: BLE001 - an API error or a timeout: this attempt failed
            log.warning("the Lease %s/%s: %s", self.namespace, self.name, exc)
            transitions = None
        if transitions is not None:
            self._renewed = started
            if not self.leading:
                self.leading = True
                log.info("holding the Lease %s/%s (transition %d)", self.namespace, self.name, transitions)
                self._on_leading(transitions)
        if self.leading and self._left() <= 0:
            self._on_lost(f"could not renew the Lease {self.namespace}/{self.name} within {RENEW_DEADLINE:g} s")
            return False
        return True

    def _try_acquire_or_renew(self, now: float, timeout: float) -> int | None:
        """The Lease's leaseTransitions if this replica holds it after this call, else None."""
        if self.leading and self._held is not None:
            try:
                return self._renew(*self._held, timeout)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                self._held = None  # another replica wrote the Lease: read what it holds now
        try:
            lease = self._api.read_namespaced_lease(self.name, self.namespace, _request_timeout=timeout)
        except ApiException as exc:
            if exc.status != 404:
                raise
            body = {"metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": self._spec(None, transitions=0)}  # fmt: skip
            created = self._api.create_namespaced_lease(self.namespace, body, _request_timeout=timeout)
            self._held = (created.metadata.resource_version, 0)
            return 0
        spec = lease.spec
        record = (spec.holder_identity, spec.renew_time, spec.lease_transitions)
        if record != self._seen:
            self._seen, self._seen_at = record, now
        renewing = self.leading and spec.holder_identity == self.identity
        # Held by another, or by this name before this process started (a restarted container): wait for it to expire.
        if spec.holder_identity and not renewing and now - self._seen_at < (spec.lease_duration_seconds or LEASE_DURATION):
            return None
        transitions = (spec.lease_transitions or 0) + (0 if renewing else 1)
        # The resourceVersion makes the patch conditional (409 if another replica wrote in between).
        patch = {"metadata": {"resourceVersion": lease.metadata.resource_version},
                 "spec": self._spec(spec.acquire_time if renewing else None, transitions)}  # fmt: skip
        return self._patch(patch, transitions, timeout)

    def _renew(self, version: str, transitions: int, timeout: float) -> int:
        """Renew with one patch, conditional on ``version`` (409 if another replica wrote since)."""
        now = micro_time(datetime.datetime.now(datetime.UTC))
        return self._patch({"metadata": {"resourceVersion": version},
                            "spec": {"holderIdentity": self.identity, "renewTime": now}}, transitions, timeout)  # fmt: skip

    def _patch(self, patch: dict[str, Any], transitions: int, timeout: float) -> int:
        patched = self._api.patch_namespaced_lease(self.name, self.namespace, patch, _request_timeout=timeout,
                                                   _content_type="application/merge-patch+json")  # fmt: skip
        self._held = (patched.metadata.resource_version, transitions)
        return transitions

    def _spec(self, acquired: datetime.datetime | None, transitions: int) -> dict[str, Any]:
        now = datetime.datetime.now(datetime.UTC)
        return {"holderIdentity": self.identity, "leaseDurationSeconds": int(LEASE_DURATION),
                "acquireTime": micro_time(acquired or now), "renewTime": micro_time(now),
                "leaseTransitions": transitions}  # fmt: skip


def micro_time(at: datetime.datetime) -> str:
    """A Lease's MicroTime: RFC 3339 with exactly six fractional digits, in UTC."""
    return at.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
