"""The weights and the pool go on huge pages after warm-up (hugepages.py):
contents unchanged, whatever the system offers."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kvd.engine import hugepages  # noqa: E402
from kvd.engine.engine import Engine, EngineConfig  # noqa: E402
from kvd.engine.hugepages import HUGE_PAGE, back_with_huge_pages, buffer_ranges  # noqa: E402
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


@pytest.mark.parametrize("run", [hugepages.COLLAPSE_RUN, 2 * HUGE_PAGE])
def test_a_large_array_keeps_its_contents(run: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """In one call, or a few huge pages a call (``COLLAPSE_RUN``)."""
    monkeypatch.setattr(hugepages, "COLLAPSE_RUN", run)
    values = np.random.default_rng(1).integers(-128, 127, 16 * HUGE_PAGE, dtype=np.int8)
    array = jnp.asarray(values)
    collapsed = back_with_huge_pages([array])
    assert 0 <= collapsed <= array.nbytes
    assert collapsed % HUGE_PAGE == 0
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
