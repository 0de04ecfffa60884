"""The decode step updates the KV pool in place on this backend: its cost and
memory must not follow the pool's size when one short sequence is live.

Guards against a full-pool copy sneaking into the step (a scatter done out of
place, a layout change of the pool view, donation that does not alias): the
compiled body aliases the pool to its output, its scratch does not grow with
the pool, and the pool's device buffer is the same one after steps."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kvd.engine.engine import Engine, EngineConfig  # noqa: E402
from kvd.engine.loader import LoadedModel, random_model  # noqa: E402
from kvd.oneshot.batch import BatchGenerator  # noqa: E402
from kvd.sched.sampling_params import SamplingParams  # noqa: E402


def _model() -> LoadedModel:
    return random_model(vocab_size=96, sliding_window=12, seed=3)


def _engine(model: LoadedModel, pool_tokens: int, kv_dtype: str | None = None) -> Engine:
    config = EngineConfig(
        max_model_len=128,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        pool_tokens=pool_tokens,
        kv_dtype=kv_dtype,
    )
    return Engine(model, config)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_decode_body_aliases_the_pool_and_its_scratch_does_not_follow_the_pool(
    kv_dtype: str,
) -> None:
    """For every pool type: a bf16 pool on XLA:CPU was converted whole to f32
    around each layer's write and read (kvquant.storage_dtype)."""
    model = _model()
    small, large = _engine(model, 256, kv_dtype), _engine(model, 16 * 256, kv_dtype)
    assert small.token_buckets[:2] == (1, 2)
    for tokens in (1, 2):  # a lone decode, and a pair (a one-row write is the risky one)
        stats = []
        for engine in (small, large):
            program = engine._body_program(tokens, engine.block_buckets[-1])
            memory = program.memory_analysis()
            assert memory.alias_size_in_bytes >= engine.pool.nbytes  # the pool is the output
            stats.append(memory.temp_size_in_bytes)
        assert stats[0] == stats[1], f"{tokens} token(s): scratch grows with the pool: {stats}"


def test_steps_keep_the_pool_buffer() -> None:
    engine = _engine(_model(), 1024)
    before = engine.pool.unsafe_buffer_pointer()
    BatchGenerator(engine).generate(
        [[1, 5, 9, 13, 17]], [SamplingParams(temperature=0.0, max_tokens=6)]
    )
    assert engine.pool.unsafe_buffer_pointer() == before, "a step copied the pool"


def test_the_head_multiplies_rows_the_decoder_step_already_normed() -> None:
    """The final norm runs in the decoder step: in the head, XLA fuses it into
    the output projection's product and redoes it for every vocabulary row."""
    engine = _engine(_model(), 256)
    body = engine._body_program(1, engine.block_buckets[-1]).as_text()
    head = engine._head_program(1).as_text()
    assert "rsqrt" in body
    assert "rsqrt" not in head


def test_warm_up_runs_live_tokens_that_write_only_the_null_page() -> None:
    """The first runs at warm-up attend over live tokens (so attention's loops
    run, and their kernels are set up before the first request), all of whose
    blocks are the null page: nothing else in the pool is written."""
    engine = _engine(_model(), 1024)
    engine.warm_up()
    pool = np.asarray(engine.pool)
    assert not np.any(pool[1:]), "warm-up wrote outside the null page"
    # Padding writes one slot of the null page; live tokens, at their
    # positions, write every slot of it.
    block = engine.layout.block_size
    slots = pool[0].reshape(-1, 2, block, pool.shape[1] // (2 * block))  # [places, K/V, slot, row]
    written = np.any(slots != 0, axis=(0, 1, 3))
    assert written.all(), f"slots written: {np.flatnonzero(written).tolist()}"
