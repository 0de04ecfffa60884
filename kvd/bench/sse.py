"""A streamed reply's lines, split as the event stream's grammar splits
them: at ``\\n``, ``\\r\\n`` or ``\\r`` only. httpx's ``iter_lines`` splits
as ``str.splitlines`` does, also at U+2028, U+2029 and U+0085, which JSON
allows raw inside a string, so an event holding one would arrive cut in
two. kvd escapes them; other servers (the peers the benches measure
against) may not."""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

_BREAK = re.compile(r"\r\n|\r|\n")


class _Splitter:
    """Text in, whole lines out; a trailing ``\\r`` is held back, since the
    next text may begin with the ``\\n`` of the same break."""

    def __init__(self) -> None:
        self.pending = ""

    def push(self, text: str) -> list[str]:
        pending = self.pending + text
        held = pending.endswith("\r")
        *complete, rest = _BREAK.split(pending[:-1] if held else pending)
        self.pending = rest + ("\r" if held else "")
        return complete

    def end(self) -> list[str]:
        """The last line, if the text did not end with a break (or ended
        with a held ``\\r``)."""
        pending, self.pending = self.pending, ""
        return [pending.removesuffix("\r")] if pending else []


def lines(texts: Iterable[str]) -> Iterator[str]:
    """The lines of ``texts`` (a response's ``iter_text()``)."""
    splitter = _Splitter()
    for text in texts:
        yield from splitter.push(text)
    yield from splitter.end()


async def alines(texts: AsyncIterable[str]) -> AsyncIterator[str]:
    """The lines of ``texts`` (a response's ``aiter_text()``)."""
    splitter = _Splitter()
    async for text in texts:
        for line in splitter.push(text):
            yield line
    for line in splitter.end():
        yield line
