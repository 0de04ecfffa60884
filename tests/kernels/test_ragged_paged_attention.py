"""The Pallas kernel in TPU interpret mode (on CPU) against the engine's jnp
reference, on random ragged batches over random page tables."""

from __future__ import annotations

import os
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from kvd.engine.attention import paged_attention  # noqa: E402
from kvd.engine.kvquant import dequantise, quantise  # noqa: E402
from kvd_kernels.ragged_paged_attention import ragged_paged_attention  # noqa: E402

pltpu = pytest.importorskip("jax.experimental.pallas.tpu")


def ragged_batch(
    rng: np.random.Generator,
    chunks: list[tuple[int, int]],  # per sequence: (tokens already in the cache, new tokens)
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    width: int,
    places: int,
    dtype: jnp.dtype,
) -> dict[str, object]:
    num_seqs = len(chunks)
    pages = 1 + num_seqs * width  # page 0 is the null page
    view = rng.standard_normal((pages, places, 2, block_size, kv_heads, head_dim))
    view[0] = 0.0
    order = rng.permutation(np.arange(1, pages))
    tables = order[: num_seqs * width].reshape(num_seqs, width).astype(np.int32)
    seq_index, positions = [], []
    for s, (cached, new) in enumerate(chunks):
        assert cached + new <= width * block_size
        seq_index += [s] * new
        positions += list(range(cached, cached + new))
    tokens = len(positions)
    q = rng.standard_normal((tokens, heads, head_dim))
    return {
        "q": jnp.asarray(q, dtype),
        "view": jnp.asarray(view, dtype),
        "tables": jnp.asarray(tables),
        "seq_index": jnp.asarray(seq_index, jnp.int32),
        "positions": jnp.asarray(positions, jnp.int32),
    }


CASES = {
    "decode-only": [(5, 1), (16, 1), (31, 1), (47, 1)],
    "prefill-only": [(0, 7), (0, 17)],
    "mixed": [(0, 5), (16, 1), (3, 9), (40, 1)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    ("window", "softcap", "kv_heads", "dtype"),
    [
        (None, None, 2, "float32"),
        (20, None, 1, "float32"),
        (None, 50.0, 2, "bfloat16"),
        (9, None, 2, "bfloat16"),
    ],
)
def test_kernel_matches_reference(
    case: str, window: int | None, softcap: float | None, kv_heads: int, dtype: str
) -> None:
    rng = np.random.default_rng(zlib.crc32(repr((case, window, kv_heads, dtype)).encode()))
    batch = ragged_batch(
        rng,
        CASES[case],
        heads=4,
        kv_heads=kv_heads,
        head_dim=128,
        block_size=16,
        width=4,
        places=2,
        dtype=jnp.dtype(dtype),
    )
    for place in (0, 1):
        args = dict(batch, place=place)
        expected = paged_attention(**args, scale=128**-0.5, window=window, softcap=softcap)
        got = ragged_paged_attention(
            **args, scale=128**-0.5, window=window, softcap=softcap, interpret=True
        )
        tolerance = 1e-5 if dtype == "float32" else 2e-2
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(expected, np.float32),
            rtol=tolerance, atol=tolerance,
        )  # fmt: skip


def test_tpu_interpret_mode_simulates_the_dmas() -> None:
    """Pallas's TPU interpreter (DMAs, semaphores, scalar prefetch simulated)."""
    rng = np.random.default_rng(3)
    batch = ragged_batch(
        rng, CASES["mixed"], heads=4, kv_heads=2, head_dim=128, block_size=16, width=4,
        places=2, dtype=jnp.float32,
    )  # fmt: skip
    args = dict(batch, place=1, scale=0.1, window=20, softcap=None)
    expected = paged_attention(**args)
    got = ragged_paged_attention(**args, interpret=pltpu.InterpretParams())
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("head_dim", "kv_heads", "heads", "dtype"),
    [(128, 1, 4, "float32"), (256, 2, 8, "bfloat16"), (512, 4, 8, "bfloat16")],
)
def test_lowers_for_tpu_without_a_tpu(head_dim: int, kv_heads: int, heads: int, dtype: str) -> None:
    """Mosaic lowering (block-shape and tiling rules) is checked here, on CPU."""
    rng = np.random.default_rng(5)
    batch = ragged_batch(
        rng, CASES["mixed"], heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=16,
        width=4, places=3, dtype=jnp.dtype(dtype),
    )  # fmt: skip

    def attend(q, view, tables, seq_index, positions, window):  # type: ignore[no-untyped-def]
        return ragged_paged_attention(
            q, view, 2, tables, seq_index, positions, scale=0.1, window=window, softcap=30.0
        )

    lowered = (
        jax.jit(attend)
        .trace(*(batch[k] for k in ("q", "view", "tables", "seq_index", "positions")), 512)
        .lower(lowering_platforms=("tpu",))
    )
    assert "tpu_custom_call" in lowered.as_text()


@pytest.mark.parametrize(("window", "chunk"), [(10, 1), (10, 7), (6, 13)])
def test_kernel_walks_ring_tables_and_skips_padding(window: int, chunk: int) -> None:
    """Sliding tables as rings (window plus a step's chunk), padding tokens
    (position -1): the kernel and the reference agree, padding gives zeros."""
    from tests.engine.test_attention import BLOCK, build

    ring = -(-(window - 1 + chunk) // BLOCK) + 1
    for cached in (0, 9, 40):
        rng = np.random.default_rng(cached + chunk)
        args, _ = build(
            rng, [(cached, chunk), (cached + 3, 1)], ring=ring, window=window, padding=3,
            spare_rows=1, head_dim=128,
        )  # fmt: skip
        args = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in args.items()}
        expected = paged_attention(**args, scale=0.2, window=window, softcap=None)
        got = ragged_paged_attention(**args, scale=0.2, window=window, softcap=None, interpret=True)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
        assert np.all(np.asarray(got)[-3:] == 0)


@pytest.mark.parametrize("window", [None, 20])
def test_kernel_dequantises_an_int8_pool_as_the_reference_does(window: int | None) -> None:
    """Rows of head_dim int8 values and their scale: the kernel's result
    equals the reference's over the same int8 pool."""
    rng = np.random.default_rng(11)
    batch = ragged_batch(
        rng, CASES["mixed"], heads=4, kv_heads=2, head_dim=128, block_size=16, width=4,
        places=2, dtype=jnp.float32,
    )  # fmt: skip
    args = dict(
        batch, view=quantise(batch["view"]), place=1, scale=0.1, window=window, softcap=None
    )
    assert args["view"].dtype == jnp.int8
    expected = paged_attention(**args)
    got = ragged_paged_attention(**args, dequantise=dequantise, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
