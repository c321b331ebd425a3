"""The engine stream's event reader (``engine_client._SSEReader``): it splits lines itself,
so events must come out the same however the bytes were cut into reads; its deadline
fails aiohttp's own stream reader."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.streams import StreamReader

from binbatch_sidecar.engine.engine_client import EngineError, _SSEReader

STREAM = (b": keep-alive\r\n\r\n"
          b'data: {"a": 1}\n\n'
          b"data: two\r\ndata: lines\r\n\r\n"
          b"event: x\ndata:no-space\n\n\n\n"
          b"data: caf\xc3\xa9\n\n"
          b"data: [DONE]")  # fmt: skip  (the last event ends with the stream, no blank line)
EVENTS = [b'{"a": 1}', b"two\nlines", b"no-space", "café".encode(), b"[DONE]"]


class _Content:
    """What the reader uses of aiohttp's StreamReader: ``readany`` (b"" at the end), its limits and
    ``set_exception``; each read gives one of ``reads``, so a test chooses where the bytes are cut."""

    def __init__(self, reads: list[bytes], limit: int = 1 << 17) -> None:
        self.reads, self.limit = list(reads), limit

    async def readany(self) -> bytes:
        return self.reads.pop(0) if self.reads else b""

    def get_read_buffer_limits(self) -> tuple[int, int]:
        return self.limit // 2, self.limit

    def set_exception(self, exc: BaseException) -> None:
        raise AssertionError(f"the deadline passed in a test that reads at once: {exc}")


class _Protocol:
    """What aiohttp's StreamReader asks of its connection: an open one that never pauses."""

    connected = True
    _reading_paused = False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self, resume_parser: bool = True) -> None:
        pass


class _Resp:
    def __init__(self, content: _Content) -> None:
        self.content = content


async def _events(reads: list[bytes], **kw) -> list[bytes]:
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
    assert await _events([b"data: " + b"x" * 50 + b"\n\n"], limit=64) == [b"x" * 50]  # within it: read


@pytest.mark.parametrize("cut", [False, True])  # whole in one read (cut out at once), or line by line
async def test_the_bound_is_the_same_for_an_event_read_whole_or_in_pieces(cut):
    at_bound = b"data: " + b"x" * 57 + b"\n"  # 64 bytes with its newline: the most a line may hold
    over = b"data: " + b"x" * 58 + b"\n"
    pieces = (lambda b: [b[:10], b[10:]]) if cut else (lambda b: [b])
    assert await _events(pieces(at_bound + b"\n"), limit=64) == [b"x" * 57]
    with pytest.raises(EngineError, match="over 64 bytes"):
        await _events(pieces(over + b"\n"), limit=64)


async def test_a_stalled_stream_ends_at_the_deadline():
    content = StreamReader(_Protocol(), 1 << 16, loop=asyncio.get_running_loop())  # type: ignore[arg-type]
    content.feed_data(b"data: partial")  # and nothing more: an engine that stalled mid-event
    reader = _SSEReader(_Resp(content), asyncio.get_running_loop().time() + 0.05)  # type: ignore[arg-type]
    with pytest.raises(TimeoutError):
        await reader.next()


async def test_a_closed_reader_leaves_no_deadline_armed():
    content = StreamReader(_Protocol(), 1 << 16, loop=asyncio.get_running_loop())  # type: ignore[arg-type]
    content.feed_data(b'data: {"a": 1}\n\ndata: [DONE]\n\n')
    content.feed_eof()
    loop = asyncio.get_running_loop()
    reader = _SSEReader(_Resp(content), loop.time() + 30)  # type: ignore[arg-type]
    assert [await reader.next(), await reader.next(), await reader.next()] == [b'{"a": 1}', b"[DONE]", None]
    reader.close()
    assert reader._timer.cancelled()  # the deadline can no longer fail a connection gone back to the pool
