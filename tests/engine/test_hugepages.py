"""The weights and the pool go on huge pages at warm-up, or the pool in a
thread while the engine serves (hugepages.py): contents unchanged,
whatever the system offers."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kvd.engine.engine import Engine, EngineConfig  # noqa: E402
from kvd.engine.hugepages import (  # noqa: E402
    HUGE_PAGE,
    Collapser,
    back_with_huge_pages,
    buffer_ranges,
)
from kvd.engine.loader import random_model  # noqa: E402
from kvd.oneshot.batch import BatchGenerator  # noqa: E402
from kvd.sched.sampling_params import SamplingParams  # noqa: E402


def test_neighbouring_buffers_merge_and_far_ones_do_not() -> None:
    arrays = [jnp.arange(n * 1024, dtype=jnp.float32) for n in (1, 700, 3000)]
    ranges = buffer_ranges(arrays)
    covered = sum(end - start for start, end in ranges)
    assert covered >= sum(a.nbytes for a in arrays)
    for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
        assert start - end >= HUGE_PAGE  # closer ones were merged


def test_a_large_array_keeps_its_contents() -> None:
    values = np.random.default_rng(1).integers(-128, 127, 16 * HUGE_PAGE, dtype=np.int8)
    array = jnp.asarray(values)
    collapsed = back_with_huge_pages([array])
    assert 0 <= collapsed <= array.nbytes + 2 * HUGE_PAGE
    np.testing.assert_array_equal(np.asarray(array), values)


def test_a_collapse_in_its_thread_reports_once_and_keeps_the_contents() -> None:
    values = np.random.default_rng(2).normal(size=4 * HUGE_PAGE).astype(np.float32)
    array = jnp.asarray(values)
    reports: list[tuple[int, float]] = []
    collapser = Collapser([array], lambda collapsed, seconds: reports.append((collapsed, seconds)))
    np.testing.assert_array_equal(np.asarray(array), values)  # read while it runs
    assert collapser.join(120)
    ((collapsed, seconds),) = reports
    assert collapsed == collapser.collapsed
    assert 0 <= collapsed <= array.nbytes and seconds >= 0
    np.testing.assert_array_equal(np.asarray(array), values)


def test_an_engine_decodes_the_same_after_warm_up_moves_it() -> None:
    model = random_model(vocab_size=96, sliding_window=12, seed=9)
    config = EngineConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16)
    greedy = [SamplingParams(temperature=0.0, max_tokens=8)]
    cold = Engine(model, config)
    before = BatchGenerator(cold).generate([[1, 4, 9, 16]], greedy)[0].completion_ids
    warm = Engine(model, config)
    warm.warm_up()
    assert warm.huge_page_bytes >= 0
    after = BatchGenerator(warm).generate([[1, 4, 9, 16]], greedy)[0].completion_ids
    assert after == before


def test_an_engine_decodes_the_same_while_and_after_its_pool_is_collapsed() -> None:
    """As a daemon does: the weights at warm-up, the pool in a thread."""
    model = random_model(vocab_size=96, sliding_window=12, seed=9)
    config = EngineConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16)
    greedy = [SamplingParams(temperature=0.0, max_tokens=8)]
    before = BatchGenerator(Engine(model, config)).generate([[1, 4, 9, 16]], greedy)[0]
    engine = Engine(model, config)
    engine.warm_up(pool_huge_pages=False)
    reports: list[int] = []
    collapser = engine.collapse_pool_later(lambda collapsed, seconds: reports.append(collapsed))
    assert engine.pool_huge_pages is collapser
    during = BatchGenerator(engine).generate([[1, 4, 9, 16]], greedy)[0]
    assert collapser.join(120)
    after = BatchGenerator(engine).generate([[1, 4, 9, 16]], greedy)[0]
    assert during.completion_ids == after.completion_ids == before.completion_ids
    assert reports == [collapser.collapsed]
    assert 0 <= collapser.collapsed <= engine.pool.nbytes
