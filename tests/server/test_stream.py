"""Streaming in batches: what waits when a reader wakes is taken at once, and
text decoded from several tokens at once equals the token-by-token text."""

from __future__ import annotations

import pytest
import trio

from kvd.engine.loader import random_model_with_tokenizer
from kvd.engine.tokenizer import Tokenizer
from kvd.sched.scheduler import StepEvent
from kvd.server.runtime import waiting_batches
from kvd.server.stopstrings import StopStrings
from kvd.server.textstream import TextStream


def test_a_slow_reader_gets_what_waits_as_one_batch() -> None:
    async def main() -> list[list[int | None]]:
        send, receive = trio.open_memory_channel[StepEvent](100)
        seen: list[list[int | None]] = []
        for token in range(5):  # the engine ran 5 steps before the reader woke
            send.send_nowait(StepEvent("r", token, 0.0, False))
        batches = waiting_batches(receive)
        seen.append([e.token for e in await anext(batches)])
        send.send_nowait(StepEvent("r", 5, 0.0, False))
        seen.append([e.token for e in await anext(batches)])
        send.send_nowait(StepEvent("r", 6, 0.0, True, "length"))
        send.send_nowait(StepEvent("r", None, 0.0, True, "cancelled"))
        await send.aclose()
        seen.append([e.token for e in await anext(batches)])
        with pytest.raises(StopAsyncIteration):
            await anext(batches)
        return seen

    assert trio.run(main) == [[0, 1, 2, 3, 4], [5], [6, None]]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    model = random_model_with_tokenizer(max_position=64)
    assert model.tokenizer is not None
    return model.tokenizer


def test_many_tokens_at_once_decode_as_one_at_a_time(tokenizer: Tokenizer) -> None:
    text = "Les élèves 東京 naïve — emoji 🙂 and\nnew lines. " * 3
    ids = tokenizer.encode(text)[1:]  # without BOS
    one = TextStream(tokenizer)
    singly = "".join(one.push(t) for t in ids) + one.flush()
    for size in (2, 3, 7, len(ids)):
        many = TextStream(tokenizer)
        chunks = [many.push_many(ids[i : i + size]) for i in range(0, len(ids), size)]
        assert "".join(chunks) + many.flush() == singly == text


@pytest.mark.parametrize("stop", [("naïve",), ("🙂",), ("\nnew", "zzz"), (" —",)])
def test_stop_strings_end_at_the_token_completing_one(
    tokenizer: Tokenizer, stop: tuple[str, ...]
) -> None:
    """The scheduler's watch (StopStrings) says stop at the token whose text
    completes the first stop string, and the relay's text is what precedes it."""
    text = "Les élèves 東京 naïve — emoji 🙂 and\nnew lines. "
    ids = tokenizer.encode(text)[1:]  # without BOS
    watch = StopStrings(tokenizer, stop)
    fresh = watch.fork()
    ended = next(i for i, token in enumerate(ids) if watch.accept(token))
    first = min(text.find(s) for s in stop if s in text)
    end = first + len(next(s for s in stop if text.find(s) == first))
    assert len(tokenizer.decode(ids[:ended])) < end <= len(tokenizer.decode(ids[: ended + 1]))
    stream = TextStream(tokenizer, stop)
    assert stream.push_many(ids[: ended + 1]) + stream.flush() == text[:first]
    assert not any(fresh.accept(token) for token in ids[:ended])  # a fork starts afresh


def test_stop_strings_refuse_an_empty_one(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings(tokenizer, ("",))
