"""Generated tokens to text for a client: incremental, with stop strings.

Text is released as soon as it is final: complete characters (the
StreamDecoder's guarantee) that cannot be the start of a stop string. The
last ``longest stop - 1`` characters are held back until more text shows
whether a stop string begins there. A stop string is never sent; what came
before it is.
"""

from __future__ import annotations

from kvd.engine.tokenizer import StreamDecoder, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._decoder = StreamDecoder(tokenizer)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._pending = ""
        self.stopped = False  # a stop string was found: nothing after it is sent

    def push(self, token: int) -> str:
        """Text that may be sent now (possibly empty)."""
        return self.push_many((token,))

    def push_many(self, tokens: tuple[int, ...] | list[int]) -> str:
        """Text that may be sent now, after several tokens decoded at once."""
        if self.stopped:
            return ""
        self._pending += self._decoder.push(tuple(tokens))
        return self._release(final=False)

    def flush(self) -> str:
        """Everything still held back, at the end of the generation."""
        if self.stopped:
            return ""
        self._pending += self._decoder.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        pending = self._pending
        if self._stop:
            cut = min((i for i in (pending.find(s) for s in self._stop) if i >= 0), default=-1)
            if cut >= 0:
                self.stopped = True
                self._pending = ""
                return pending[:cut]
        keep = 0 if final else min(self._hold, len(pending))
        released = pending[: len(pending) - keep]
        self._pending = pending[len(released) :]
        return released
