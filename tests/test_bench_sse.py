"""The benches' event-stream lines: split at line breaks of the stream's
grammar only, wherever the response's text was cut."""

from __future__ import annotations

from collections.abc import AsyncIterator

import trio

from kvd.bench.sse import alines, lines

# Two events whose JSON holds what str.splitlines would break at, then a
# last line with no break after it.
STREAM = 'data: {"t":"a\u2028b\u2029c\x85d"}\r\n\r\ndata: {"t":"e\x1cf"}\n\ndata: [DONE]'
EXPECTED = ['data: {"t":"a\u2028b\u2029c\x85d"}', "", 'data: {"t":"e\x1cf"}', "", "data: [DONE]"]


def test_lines_break_only_where_the_stream_does_however_the_text_is_cut() -> None:
    assert list(lines([STREAM])) == EXPECTED
    for cut in range(len(STREAM) + 1):  # every place, the \r\n pair split included
        assert list(lines([STREAM[:cut], STREAM[cut:]])) == EXPECTED, cut
    assert list(lines(STREAM)) == EXPECTED  # one character at a time
    assert list(lines(["a\r", "\rb\r"])) == ["a", "", "b"]  # a bare \r is a break
    assert list(lines([])) == [] and list(lines(["", ""])) == []


def test_async_lines_match() -> None:
    async def texts() -> AsyncIterator[str]:
        for i in range(0, len(STREAM), 7):
            yield STREAM[i : i + 7]
            await trio.lowlevel.checkpoint()

    async def main() -> list[str]:
        return [line async for line in alines(texts())]

    assert trio.run(main) == EXPECTED
