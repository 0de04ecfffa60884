"""The products with int8 weights, form by form, against f32 (XLA on this
machine's backend): what ``kvd/engine/qdense.py`` chooses from.

- 18 layer matrices (640 x 2048, the 270M's MLP shape, 94 MB in f32: more
  than the caches hold, as in the model), unrolled as the engine runs them:
  f32, the conversion where it is multiplied with nothing ordering it (XLA
  then converts every layer at the start, into a scratch of them all), the
  form kvd uses, each conversion made to wait for its layer's input, and the
  transposed twin's fused form that kvd uses for one token
  (``qdense.OneRowTwin``);
- the output projection (262,144 x 640): f32, fused, and dequantised a
  vocabulary chunk at a time (several chunk sizes).

Run: .venv/bin/python scripts/bench_weight_products.py [--rows 1,2,4,8,32]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvd.engine.qdense import after

LAYERS, WIDTH, FFN = 18, 640, 2048
VOCAB = 262_144
BLOCK = 32


def best_ms(fn: Callable[..., Any], *args: Any, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            out = fn(*args)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - start) / repeats)
    return min(rounds) * 1e3


def by_rows(values: Any, scale: Any) -> Any:  # blocks down axis 0 of [in, out]
    rows, cols = values.shape
    blocks = values.astype(jnp.float32).reshape(rows // BLOCK, BLOCK, cols)
    return (blocks * scale[:, None, :]).reshape(rows, cols)


def by_cols(values: Any, scale: Any) -> Any:  # blocks along axis 1 of [V, D]
    rows, cols = values.shape
    blocks = values.astype(jnp.float32).reshape(rows, cols // BLOCK, BLOCK)
    return (blocks * scale[:, :, None]).reshape(rows, cols)


def layer_stack(product: Callable[[Any, Any], Any]) -> Any:
    def run(x: Any, weights: list[Any]) -> Any:
        for weight in weights:
            x = jnp.tanh(product(x, weight))[:, :WIDTH]
        return x

    return jax.jit(run)


def chunked_head(chunk: int) -> Any:
    def run(x: Any, values: Any, scale: Any) -> Any:
        count = VOCAB // chunk

        def one(part: Any) -> Any:
            return jax.lax.optimization_barrier(by_cols(*part)) @ x.T

        parts = (values.reshape(count, chunk, WIDTH), scale.reshape(count, chunk, -1))
        return jax.lax.map(one, parts).reshape(VOCAB, -1)

    return jax.jit(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,32,512")
    rows = [int(r) for r in parser.parse_args().rows.split(",")]
    rng = np.random.default_rng(0)
    put = jax.device_put
    layers_f32 = [put(rng.standard_normal((WIDTH, FFN)).astype(np.float32)) for _ in range(LAYERS)]
    layers_int8 = [
        (
            put(rng.integers(-127, 128, (WIDTH, FFN)).astype(np.int8)),
            put(rng.random((WIDTH // BLOCK, FFN)).astype(np.float32)),
        )
        for _ in range(LAYERS)
    ]
    layers_twin = [  # [out, in], blocks along the rows: the one-token twins
        (
            put(rng.integers(-127, 128, (FFN, WIDTH)).astype(np.int8)),
            put(rng.random((FFN, WIDTH // BLOCK)).astype(np.float32)),
        )
        for _ in range(LAYERS)
    ]
    f32 = layer_stack(lambda x, w: x @ w)
    twin = layer_stack(lambda x, w: x @ by_cols(*w).T)
    unordered = layer_stack(lambda x, w: x @ by_rows(*w))
    ordered = layer_stack(lambda x, w: x @ (by_rows(*w) * after(x)))
    print(f"{LAYERS} layers of {WIDTH}x{FFN}, unrolled (ms per pass)")
    for n in rows:
        x = put(rng.standard_normal((n, WIDTH)).astype(np.float32))
        print(
            f"  rows {n:4d}: f32 {best_ms(f32, x, layers_f32):8.2f}  "
            f"unordered {best_ms(unordered, x, layers_int8):8.2f}  "
            f"kvd {best_ms(ordered, x, layers_int8):8.2f}  "
            f"twin {best_ms(twin, x, layers_twin):8.2f}",
            flush=True,
        )
    del layers_f32, layers_int8, layers_twin
    embed = put(rng.standard_normal((VOCAB, WIDTH)).astype(np.float32))
    values = put(rng.integers(-127, 128, (VOCAB, WIDTH)).astype(np.int8))
    scale = put(rng.random((VOCAB, WIDTH // BLOCK)).astype(np.float32))
    head_f32 = jax.jit(lambda x, e: (x @ e.T).T)
    head_fused = jax.jit(lambda x, v, s: (x @ by_cols(v, s).T).T)
    chunks = {size: chunked_head(size) for size in (1024, 2048, 4096, 8192)}
    print(f"output projection {VOCAB}x{WIDTH} (ms)")
    for n in [r for r in rows if r <= 32]:
        x = put(rng.standard_normal((n, WIDTH)).astype(np.float32))
        figures = [
            f"f32 {best_ms(head_f32, x, embed):7.2f}",
            f"fused {best_ms(head_fused, x, values, scale):7.2f}",
            *(f"chunk {c} {best_ms(f, x, values, scale):7.2f}" for c, f in chunks.items()),
        ]
        print(f"  rows {n:3d}: " + "  ".join(figures), flush=True)


if __name__ == "__main__":
    main()
