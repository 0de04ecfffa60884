"""A request's stop strings, watched in its output text for the scheduler
(``kvd.sched.stopping.StopCondition``): the scheduler ends the generation
with the token that completes one, and the relay (``textstream.py``) cuts
the text there."""

from __future__ import annotations

from kvd.engine.tokenizer import StreamDecoder, Tokenizer


class StopStrings:
    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        if not stops or not all(stops):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._stops = stops
        self._decoder = StreamDecoder(tokenizer)
        # The text a stop string could still be completing: its longest
        # length less one character.
        self._keep = max(len(s) for s in stops) - 1
        self._tail = ""

    def accept(self, token: int) -> bool:
        text = self._tail + self._decoder.push((token,))
        if any(stop in text for stop in self._stops):
            return True
        self._tail = text[-self._keep :] if self._keep else ""
        return False

    def fork(self) -> StopStrings:
        return StopStrings(self._tokenizer, self._stops)
