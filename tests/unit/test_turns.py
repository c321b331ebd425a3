"""turns.Turns: how many callers go on in each turn of the event loop, and in what order."""

from __future__ import annotations

import asyncio

import pytest

from binbatch_sidecar.server.turns import PER_TURN, Turns


class LoopTurns:
    """Counts the event loop's turns: a callback that runs once in every turn and schedules itself again."""

    def __init__(self) -> None:
        self.now = 0
        self._stopped = False
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        if not self._stopped:
            self.now += 1
            asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self._stopped = True


@pytest.mark.parametrize("per_turn", [1, PER_TURN, 4])
async def test_callers_arriving_in_one_turn_go_on_a_few_a_turn_in_arrival_order(per_turn):
    turns, clock, went = Turns(per_turn), LoopTurns(), []

    async def caller(i: int) -> None:
        await turns.take()
        went.append((i, clock.now))

    await asyncio.gather(*(caller(i) for i in range(10)))  # all ten start in the same turn
    clock.stop()
    assert [i for i, _ in went] == list(range(10))
    per = {}
    for _, turn in went:
        per[turn] = per.get(turn, 0) + 1
    assert max(per.values()) == per_turn and len(per) == -(-10 // per_turn)  # ceil: no turn goes unused
    seen = sorted(per)
    assert all(b > a for a, b in zip(seen, seen[1:]))


async def test_a_lone_caller_goes_on_without_yielding_to_the_loop():
    turns, ran = Turns(1), []
    asyncio.get_running_loop().call_soon(ran.append, "the loop ran")
    await turns.take()
    assert ran == []  # take() returned before anything else the loop had ready
    await asyncio.sleep(0)  # ok-sleep: one turn of the loop, the unit under test
    assert ran == ["the loop ran"]
    await asyncio.sleep(0)  # ok-sleep: a turn later the turn is free again: no wait
    await turns.take()
    assert ran == ["the loop ran"]


async def test_a_caller_that_leaves_while_waiting_gives_its_turn_to_the_next():
    turns, went = Turns(1), []

    async def caller(i: int) -> None:
        await turns.take()
        went.append(i)

    tasks = [asyncio.create_task(caller(i)) for i in range(4)]
    await asyncio.sleep(0)  # ok-sleep: one turn: all four asked, 0 went on, 1-3 wait
    tasks[1].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert went == [0, 2, 3]
    assert tasks[1].cancelled()
    await asyncio.sleep(0)  # ok-sleep: one turn, for the last _next
    await asyncio.wait_for(turns.take(), timeout=1)  # nothing was left holding a turn


def test_a_turn_takes_at_least_one_caller():
    with pytest.raises(ValueError, match="per_turn"):
        Turns(0)
