"""The engine stream's event reader (``engine_client._SSEReader``): it splits lines itself,
so events must come out the same however the bytes were cut into reads."""

from __future__ import annotations

import asyncio

import pytest

from binbatch_sidecar.engine.engine_client import EngineError, _SSEReader

STREAM = (b": keep-alive\r\n\r\n"
          b'data: {"a": 1}\n\n'
          b"data: two\r\ndata: lines\r\n\r\n"
          b"event: x\ndata:no-space\n\n\n\n"
          b"data: caf\xc3\xa9\n\n"
          b"data: [DONE]")  # fmt: skip  (the last event ends with the stream, no blank line)
EVENTS = ['{"a": 1}', "two\nlines", "no-space", "café", "[DONE]"]


class _Content:
    """What the reader uses of aiohttp's StreamReader: ``readany`` (b"" at the end) and its limits."""

    def __init__(self, reads: list[bytes], limit: int = 1 << 17, stall: asyncio.Event | None = None) -> None:
        self.reads, self.limit, self.stall = list(reads), limit, stall

    async def readany(self) -> bytes:
        if not self.reads and self.stall is not None:
            await self.stall.wait()  # an engine that sends nothing more
        return self.reads.pop(0) if self.reads else b""

    def get_read_buffer_limits(self) -> tuple[int, int]:
        return self.limit // 2, self.limit


class _Resp:
    def __init__(self, content: _Content) -> None:
        self.content = content


async def _events(reads: list[bytes], **kw) -> list[str]:
    reader = _SSEReader(_Resp(_Content(reads, **kw)), asyncio.get_running_loop().time() + 30)  # type: ignore[arg-type]
    out = []
    while (event := await reader.next()) is not None:
        out.append(event)
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 7, 16, len(STREAM)])
async def test_events_are_the_same_however_the_stream_is_cut_into_reads(size):
    reads = [STREAM[i : i + size] for i in range(0, len(STREAM), size)]
    assert await _events(reads) == EVENTS


async def test_a_line_over_the_readline_bound_fails_the_stream_as_an_engine_error():
    with pytest.raises(EngineError, match="unreadable stream line: over 64 bytes") as err:
        await _events([b"data: " + b"x" * 40, b"y" * 40, b"\n\n"], limit=64)
    assert err.value.kind == "internal"
    assert await _events([b"data: " + b"x" * 50 + b"\n\n"], limit=64) == ["x" * 50]  # within it: read


async def test_a_stalled_stream_ends_at_the_deadline():
    content = _Content([b"data: partial"], stall=asyncio.Event())
    reader = _SSEReader(_Resp(content), asyncio.get_running_loop().time() + 0.05)  # type: ignore[arg-type]
    with pytest.raises(TimeoutError):
        await reader.next()
