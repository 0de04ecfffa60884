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
