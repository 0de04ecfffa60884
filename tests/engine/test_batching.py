"""Host-side batch assembly: the decode-only packing equals the general one."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.engine.batching import assemble_step_batch, pack, pack_decode_step


@pytest.mark.parametrize(("count", "num_seqs", "num_tokens"), [(5, 8, 8), (8, 8, 8), (3, 4, 16)])
def test_decode_packing_equals_the_general_packing(
    count: int, num_seqs: int, num_tokens: int
) -> None:
    rng = np.random.default_rng(count)
    groups, width, block_size = 3, 6, 4
    tables = rng.integers(1, 500, (groups, num_seqs, width)).astype(np.int32)
    tables[:, count:] = 0  # padding rows are null
    starts = rng.integers(0, width * block_size, count)
    tokens = rng.integers(0, 1000, count)
    general = pack(
        assemble_step_batch(
            tokens.tolist(), starts.tolist(), [1] * count, tables, block_size, num_tokens
        )
    )
    fast = pack_decode_step(tokens, starts, tables, block_size, num_tokens)
    assert fast.dtype == general.dtype and np.array_equal(fast, general)


def test_sampling_rows_are_gathered_once_and_never_written_after() -> None:
    """Steady decode asks for the same rows step after step: the gathered
    floats are reused as they are, each step gets its own ints (they carry
    positions), and a row written anew (a new sequence there) is seen at once.
    An array handed to one step is never changed by a later one: that step
    may still be reading it."""
    from kvd.engine.batching import SequenceRows
    from kvd.kv.columns import SequenceColumns
    from kvd.kv.sequence import Sequence
    from kvd.sched.sampling_params import SamplingParams

    columns = SequenceColumns(4)
    seqs = [Sequence(i, "t", [1, 2, 3], 0, i, None, 1, columns) for i in range(2)]
    slots = np.array([seq.slot for seq in seqs])
    cache = SequenceRows(groups=1, width=4)
    warm, cold = SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.3, seed=2)
    rows = cache.prepare(seqs, slots, [warm, cold], np.zeros(2, np.int64), np.array([1, 2]))
    ints, floats = cache.sampling(rows, np.array([5, 6]))
    again, floats_again = cache.sampling(rows, np.array([7, 8]))
    width = len(ints) // 2
    assert floats_again is floats and floats[0] == pytest.approx(0.7)
    assert ints[[2, width + 2]].tolist() == [5, 6] and again[[2, width + 2]].tolist() == [7, 8]
    replaced = SamplingParams(temperature=0.2, seed=3)  # a new sequence in the first row
    cache.prepare(seqs, slots, [replaced, None], np.zeros(2, np.int64), np.array([3, 2]))
    _ints, fresh = cache.sampling(rows, np.array([9, 10]))
    assert fresh[0] == pytest.approx(0.2) and fresh[len(fresh) // 2] == pytest.approx(1.3)
    assert floats[0] == pytest.approx(0.7)  # the earlier steps' array is as it was
    assert ints[2] == 5 and again[2] == 7


def test_logit_biases_travel_only_with_a_row_that_has_them() -> None:
    """A step none of whose rows has a logit bias sends no bias rows; one
    that has them sends every row's, a row of a sequence without biases
    neutral even where an earlier sequence of that row had some."""
    from kvd.engine.batching import MAX_LOGIT_BIAS, SequenceRows
    from kvd.kv.columns import SequenceColumns
    from kvd.kv.sequence import Sequence
    from kvd.sched.sampling_params import SamplingParams

    columns = SequenceColumns(4)
    seqs = [Sequence(i, "t", [1, 2, 3], 0, i, None, 1, columns) for i in range(2)]
    slots = np.array([seq.slot for seq in seqs])
    cache = SequenceRows(groups=1, width=4)
    plain = SamplingParams(temperature=0.0, presence_penalty=0.5)
    rows = cache.prepare(seqs, slots, [plain, plain], np.zeros(2, np.int64), np.array([1, 2]))
    assert cache.biases(rows, 2) is None
    assert cache.penalized(rows).tolist() == [True, True]
    biased = SamplingParams(temperature=0.0, logit_bias=((7, 2.5), (9, -100.0)))
    cache.prepare(seqs, slots, [biased, None], np.zeros(2, np.int64), np.array([3, 2]))
    assert cache.penalized(rows).tolist() == [False, True]
    bias = cache.biases(np.array([*rows, 0]), 2)  # padded with the null row
    assert bias is not None and bias.shape == (3, 2 * MAX_LOGIT_BIAS)
    assert bias[0, :3].tolist() == [7, 9, -1]
    assert bias[0, MAX_LOGIT_BIAS : MAX_LOGIT_BIAS + 2].view(np.float32).tolist() == [2.5, -100.0]
    assert (bias[1:, :MAX_LOGIT_BIAS] == -1).all() and (bias[1:, MAX_LOGIT_BIAS:] == 0).all()
    assert cache.biases(rows[1:], 1) is None  # the step of the other row alone
    cache.prepare(seqs, slots, [plain, None], np.zeros(2, np.int64), np.array([4, 2]))
    assert cache.biases(rows, 2) is None  # the biased sequence's row was reused
    assert cache.bias is not None and (cache.bias[rows[0], :MAX_LOGIT_BIAS] == -1).all()
