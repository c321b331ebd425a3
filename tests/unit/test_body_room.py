"""The bodies a door is reading count against batch.maxQueuedBytes beside the queued ones
(binbatch_sidecar.server.front.Front.body_room): many clients sending large bodies at once
are refused before their bodies are held, not after."""

from __future__ import annotations

import pytest

from binbatch_sidecar.config import parse_config
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.engine.dispatcher import Rejected
from binbatch_sidecar.server.front import Fields, Front

CONFIG = parse_config({"engine": {"model": "m"}})


class Dispatcher:
    """Queues everything; ``room`` is what batch.maxQueuedBytes leaves (None: no bound)."""

    def __init__(self, room: int | None) -> None:
        self.room = room
        self.submitted = []

    def submit(self, req, call) -> None:
        self.submitted.append(req)

    def cancel(self, req) -> None:
        pass

    def byte_room(self) -> int | None:
        return self.room


def front(room: int | None) -> Front:
    return Front(Dispatcher(room), ManualClock(), config=lambda: CONFIG, default_model=lambda: "m")  # type: ignore[arg-type]


def fields(size: int) -> Fields:
    return Fields(prompt="hello", max_tokens=2, body_bytes=size)


def test_a_body_is_refused_before_it_is_read_when_the_bodies_being_read_fill_the_room():
    f = front(1000)
    with f.body_room(600):
        assert f.reading_bytes == 600
        with pytest.raises(Rejected) as err:
            with f.body_room(500):
                pass
        assert err.value.kind == "resource_exhausted" and "batch.maxQueuedBytes" in err.value.message
        with f.body_room(400):  # what is left fits
            assert f.reading_bytes == 1000
    assert f.reading_bytes == 0


def test_the_room_is_given_back_when_reading_fails():
    f = front(1000)
    with pytest.raises(RuntimeError), f.body_room(900):
        raise RuntimeError("the client left")
    assert f.reading_bytes == 0
    with f.body_room(1000):
        pass


def test_no_bound_means_no_refusal():
    f = front(None)
    with f.body_room(10**12):
        assert f.reading_bytes == 10**12


async def test_submit_counts_the_bodies_others_are_reading_but_not_its_own():
    f = front(1000)
    with f.body_room(700):  # this door's own body: it is queued within its room
        await f.submit(fields(700), False, reading=700)
    with f.body_room(700):  # another client's body being read: a request of another door does not fit
        with pytest.raises(Rejected) as err:
            await f.submit(fields(400), False)
        assert err.value.kind == "resource_exhausted"
        await f.submit(fields(300), False)
    assert len(f.dispatcher.submitted) == 2  # type: ignore[attr-defined]
