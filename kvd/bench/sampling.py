"""What one sampling call costs at a real vocabulary, by path: greedy,
temperature alone (the engine's rejection sampler over blocks), top-k/top-p
cut among the candidates, and cut over the whole vocabulary by bisection
(all rows, or one row of the batch); and what one row's logit biases, min_tokens mask, min_p,
penalties (over a 4,096-token history) or top logprobs cost a batch whose
other rows ask for none. Times are the best of a few calls, after compiling;
a one-row case is timed alternately with the batch it is compared with (the
same logits, no row asking), so a drift of the machine's speed between them
does not show as a cost. Greedy is also timed in turn with a pass that only
reads the same logits (``jnp.max``: the floor of any choice), and
temperature alone with greedy. Calls timed in turn take every order
equally often: a call's time depends on what ran just before it.

Those logits are made up: normal noise with a few tokens far ahead, where
the rejection sampler's candidates hold the mass. A real model's next-token
logits mostly spread it over their bulk, where more proposals are refused;
``model_logits`` times the same three on the embedded model's own logits
along a text (``--model-logits``)."""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgspec

HISTORY = 4096  # tokens of each row's history (the default max_model_len)
# Rounds, per repeat, of the passes timed in turn: a call takes a few
# milliseconds and the machine's speed swings between calls, so many.
ROUNDS = 16


class SamplingCase(msgspec.Struct, frozen=True):
    name: str
    ms: float
    ratio_to_temperature: float  # against temperature alone, measured in the same run
    # For a one-row case: the batch it adds to (no row asking), and the
    # median ratio to it over pairs of calls made in turn.
    compared_with: str | None = None
    ratio_to_compared: float | None = None


class ModelLogitsFigures(msgspec.Struct, frozen=True):
    model: str
    positions: int  # the text's positions whose next-token logits are the batch
    read_ms: float
    greedy_ms: float
    temperature_ms: float
    greedy_to_read: float
    temperature_to_greedy: float
    # Softmax's normaliser over the same logits (their maximum, then the sum
    # of every entry's exponential): what a draw must compute when no block
    # of the vocabulary can be bounded away, as on these logits.
    weigh_ms: float = 0.0
    temperature_to_weigh: float = 0.0


class SamplingReport(msgspec.Struct, frozen=True):
    batch: int
    vocabulary: int
    cases: list[SamplingCase]
    # A pass that only reads the same logits (``jnp.max``), and the median
    # ratios of calls made in turn: greedy to it, temperature alone to greedy.
    read_ms: float = 0.0
    greedy_to_read: float = 0.0
    temperature_to_greedy: float = 0.0
    # The same three on the embedded model's logits (None: not asked).
    model: ModelLogitsFigures | None = None


def run_sampling_bench(
    batch: int, vocabulary: int, repeats: int = 7, model_logits: bool = False
) -> SamplingReport:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvd.engine.heap import keep_freed_memory
    from kvd.engine.sampling import MAX_LOGIT_BIAS, SamplingBatch, sample, sampling_batch

    # As a ready daemon does (kvd/engine/heap.py): a call's 32 MiB temporaries
    # are not mapped afresh, page by page, each call.
    keep_freed_memory()
    # First: a batch the text cannot fill fails before the long part.
    model = _model_figures(batch, repeats) if model_logits else None
    rng = np.random.default_rng(0)
    # Peaked: a few tokens hold the mass (a nucleus among the candidates).
    peaked = rng.normal(0, 1, (batch, vocabulary)).astype(np.float32)
    peaked[:, rng.integers(0, vocabulary, 8)] += 15
    # Flat: the best 256 tokens hold a small share (a nucleus beyond them).
    flat = rng.normal(0, 0.3, (batch, vocabulary)).astype(np.float32)

    def params(temperature: float, top_k: list[int], top_p: list[float]) -> SamplingBatch:
        return sampling_batch(
            batch,
            temperature=jnp.full(batch, temperature, jnp.float32),
            top_k=jnp.asarray(top_k, jnp.int32),
            top_p=jnp.asarray(top_p, jnp.float32),
            seeds=jnp.arange(batch, dtype=jnp.uint32),
        )

    one_flat = peaked.copy()
    one_flat[0] = flat[0]
    rest = batch - 1
    cases: dict[str, tuple[np.ndarray, SamplingBatch]] = {
        "greedy": (peaked, params(0.0, [0] * batch, [1.0] * batch)),
        "temperature alone": (peaked, params(1.0, [0] * batch, [1.0] * batch)),
        "top_k 40 (among the candidates)": (peaked, params(1.0, [40] * batch, [1.0] * batch)),
        "top_p 0.9, peaked (among the candidates)": (
            peaked,
            params(1.0, [0] * batch, [0.9] * batch),
        ),
        "top_p 0.9, flat (whole vocabulary, every row)": (
            flat,
            params(1.0, [0] * batch, [0.9] * batch),
        ),
        "top_k 1000 (whole vocabulary, every row)": (
            peaked,
            params(1.0, [1000] * batch, [1.0] * batch),
        ),
        "one flat top_p 0.9 row, the rest top_k 40": (
            one_flat,
            params(1.0, [0] + [40] * rest, [0.9] + [1.0] * rest),
        ),
    }
    # What one row's extras cost the batch (against "greedy" and "temperature
    # alone" above, where no row asks and each pass is skipped).
    one_row = jnp.arange(batch) == 0
    greedy = params(0.0, [0] * batch, [1.0] * batch)
    bias_ids = (
        jnp.full((batch, MAX_LOGIT_BIAS), -1, jnp.int32).at[0].set(jnp.arange(MAX_LOGIT_BIAS))
    )
    # Every row's history is sent (the step's shape), one row is penalized.
    history = jnp.asarray(rng.integers(0, vocabulary, (batch, HISTORY)), jnp.int32)
    penalties = {
        "history": history,
        "positions": jnp.full(batch, HISTORY, jnp.int32),
        "prompt_end": jnp.full(batch, HISTORY // 2, jnp.int32),
        "presence": jnp.where(one_row, 0.5, 0.0).astype(jnp.float32),
        "frequency": jnp.where(one_row, 0.5, 0.0).astype(jnp.float32),
        "repetition": jnp.where(one_row, 1.2, 1.0).astype(jnp.float32),
    }
    cases |= {
        "greedy, one row with 300 logit biases": (
            peaked,
            greedy._replace(bias_ids=bias_ids, biases=jnp.where(bias_ids >= 0, 1.5, 0.0)),
        ),
        "greedy, one row short of min_tokens": (
            peaked,
            greedy._replace(min_end=jnp.where(one_row, 100, 0).astype(jnp.int32)),
        ),
        "greedy, one row with 20 top logprobs": (
            peaked,
            greedy._replace(top_count=jnp.where(one_row, 20, 0).astype(jnp.int32)),
        ),
        "greedy, one row with the three penalties": (peaked, greedy._replace(**penalties)),
        "temperature, one row with the three penalties": (
            peaked,
            params(1.0, [0] * batch, [1.0] * batch)._replace(**penalties),
        ),
        "temperature, one row with min_p 0.05": (
            peaked,
            params(1.0, [0] * batch, [1.0] * batch)._replace(
                min_p=jnp.where(one_row, 0.05, 0.0).astype(jnp.float32)
            ),
        ),
    }
    compared = {
        "greedy, one row with 300 logit biases": "greedy",
        "greedy, one row short of min_tokens": "greedy",
        "greedy, one row with 20 top logprobs": "greedy",
        "greedy, one row with the three penalties": "greedy",
        "temperature, one row with the three penalties": "temperature alone",
        "temperature, one row with min_p 0.05": "temperature alone",
    }
    step = jax.jit(sample)
    inputs = {name: (jnp.asarray(logits), p) for name, (logits, p) in cases.items()}
    for x, batch_params in inputs.values():
        jax.block_until_ready(step(x, batch_params))
    timed = {name: _best(step, *inputs[name], repeats) for name in cases if name not in compared}
    paired: dict[str, float] = {}
    for name, base_name in compared.items():
        timed[name], paired[name] = _alternately(step, inputs[base_name], inputs[name], repeats)
    read = jax.jit(lambda logits: jnp.max(logits, axis=1))
    peaked_logits = inputs["greedy"][0]
    jax.block_until_ready(read(peaked_logits))
    triples = _in_turn(
        {
            "read": lambda: _call(read, (peaked_logits,)),
            "greedy": lambda: _call(step, inputs["greedy"]),
            "temperature": lambda: _call(step, inputs["temperature alone"]),
        },
        ROUNDS * repeats,
    )
    base = timed["temperature alone"]
    return SamplingReport(
        batch,
        vocabulary,
        [
            SamplingCase(
                name,
                round(1000 * timed[name], 1),
                round(timed[name] / base, 2),
                compared.get(name),
                round(paired[name], 3) if name in paired else None,
            )
            for name in cases
        ],
        read_ms=round(1000 * min(r["read"] for r in triples), 2),
        greedy_to_read=round(_median_ratio(triples, "greedy", "read"), 2),
        temperature_to_greedy=round(_median_ratio(triples, "temperature", "greedy"), 2),
        model=model,
    )


# The text whose next-token logits ``_model_figures`` samples from: plain
# prose, so that each position's distribution is a real one.
TEXT = (
    "The library on the corner of the market square opens at nine on weekdays and at ten "
    "on Saturdays. Its ground floor holds newspapers, a small cafe and the children's "
    "books; the reading rooms are upstairs, where the windows look over the river. Most "
    "people come in the afternoon, after work or school, and the quietest hour is the "
    "first one, when the staff sort the returns and the light comes in low across the "
    "tables. Once a month the library holds a talk, usually about local history: the old "
    "mill, the flood of the winter the bridge went down, the families who built the "
    "houses along the water. Anyone may borrow up to ten books for three weeks, and the "
    "card is free for everyone who lives or works in the town. Visitors can read "
    "anything on the shelves, ask for help finding a book, or sit by the fire in the "
    "reading room until closing time, which is seven in the evening. "
)


def model_logits(rows: int) -> tuple[str, Any]:
    """(model name, next-token logits ``[rows, V]`` of the embedded model
    at ``rows`` positions spread along ``TEXT``), from one prefill."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvd.engine.batching import bucket, build_step_batch, powers_of_two, sliding_ring
    from kvd.engine.loader import EMBEDDED_MODEL, embedded_tokenizer, load_model
    from kvd.engine.model import EngineSpec, forward
    from kvd.kv import BudgetMode, KVManager, TenantBudget, build_layout

    ids = embedded_tokenizer().encode(TEXT)
    if rows > len(ids) - 1:
        raise ValueError(
            f"--model-logits: the text has {len(ids)} tokens, so at most a batch of {len(ids) - 1}"
        )
    loaded = load_model(EMBEDDED_MODEL, "float32", "none")
    layout = build_layout(loaded.config.kv_geometry("float32"), 16)
    pages = 2 * (len(ids) // 16 + 1) * layout.num_groups + 1
    kv = KVManager(layout, pages, mode=BudgetMode.FREE)
    kv.set_tenant("bench", TenantBudget())
    ring = sliding_ring(layout, len(ids))
    spec = EngineSpec.build(loaded.config, layout, ring)
    seq = kv.add_sequence(1, "bench", ids)
    kv.allocate(seq, len(ids))
    tokens = bucket(len(ids), powers_of_two(16, 4096))
    width = bucket(max(ring, seq.num_blocks), powers_of_two(4, 256))
    step = build_step_batch([(seq, len(ids))], layout, tokens, tokens, width, ring)
    step = step._replace(sample_index=jnp.arange(tokens, dtype=jnp.int32))
    pool = jnp.zeros((pages, layout.page_bytes // 4), jnp.float32)
    logits, _ = jax.jit(lambda p, pool, b: forward(spec, p, pool, b))(loaded.params, pool, step)
    # Past the first few tokens, whose context is too short to be typical.
    at = np.linspace(min(16, len(ids) - rows), len(ids) - 1, rows).astype(np.int32)
    return EMBEDDED_MODEL, jnp.asarray(np.asarray(logits)[at])


def _model_figures(batch: int, repeats: int) -> ModelLogitsFigures:
    """Greedy, temperature alone, a read and softmax's normaliser, timed in
    turn on the model's logits."""
    import jax
    import jax.numpy as jnp

    from kvd.engine.sampling import sample, sampling_batch

    name, logits = model_logits(batch)
    step = jax.jit(sample)
    read = jax.jit(lambda x: jnp.max(x, axis=1))
    weigh = jax.jit(lambda x: jnp.sum(jnp.exp(x - jnp.max(x, axis=1, keepdims=True)), axis=1))

    def params(temperature: float, call: int) -> Any:
        seeds = jnp.arange(call * batch, (call + 1) * batch, dtype=jnp.uint32)
        return sampling_batch(
            batch, temperature=jnp.full(batch, temperature, jnp.float32), seeds=seeds
        )

    greedy = params(0.0, 0)
    for args in ((logits, greedy), (logits, params(1.0, 0))):
        jax.block_until_ready(step(*args))
    jax.block_until_ready(read(logits))
    jax.block_until_ready(weigh(logits))
    # Each call other seeds: other proposals, as a running batch draws. The
    # batches are made (and their arrays computed) before any is timed.
    made = _balanced(ROUNDS * repeats, 4)
    drawing = iter(jax.block_until_ready([params(1.0, call) for call in range(made)]))
    rounds = _in_turn(
        {
            "read": lambda: _call(read, (logits,)),
            "greedy": lambda: _call(step, (logits, greedy)),
            "temperature": lambda: _call(step, (logits, next(drawing))),
            "weigh": lambda: _call(weigh, (logits,)),
        },
        ROUNDS * repeats,
    )

    def ms(name: str) -> float:
        return round(1000 * statistics.median(r[name] for r in rounds), 3)

    return ModelLogitsFigures(
        name,
        batch,
        ms("read"),
        ms("greedy"),
        ms("temperature"),
        round(_median_ratio(rounds, "greedy", "read"), 2),
        round(_median_ratio(rounds, "temperature", "greedy"), 2),
        ms("weigh"),
        round(_median_ratio(rounds, "temperature", "weigh"), 2),
    )


def _in_turn(passes: dict[str, Callable[[], float]], rounds: int) -> list[dict[str, float]]:
    """Each pass's time (what it returns) in each of at least ``rounds``
    rounds, every pass called once a round, the rounds taking the passes'
    orders in turn (as many rounds as make each order come equally often).
    A call's time depends on where it comes in its round: on the AMD EPYC,
    32 rows of the 270M's logits, temperature alone took 1.46x greedy when
    it came third after a read and greedy, 0.97x when it came second,
    before greedy (median ratios, 60 rounds of each order, in one run), so
    a fixed order measures the order as well as the passes."""
    orders = list(itertools.permutations(passes))
    total = _balanced(rounds, len(passes))
    return [{name: passes[name]() for name in orders[i % len(orders)]} for i in range(total)]


def _balanced(rounds: int, passes: int) -> int:
    """The rounds ``_in_turn`` makes of ``passes`` passes: ``rounds``,
    rounded up to a multiple of their orders' number."""
    orders = math.factorial(passes)
    return -(-rounds // orders) * orders


def _median_ratio(rounds: list[dict[str, float]], case: str, base: str) -> float:
    return statistics.median(r[case] / r[base] for r in rounds)


def _call(step: Callable[..., Any], args: tuple[Any, ...]) -> float:
    import jax

    start = time.perf_counter()
    jax.block_until_ready(step(*args))
    return time.perf_counter() - start


def _best(step: Callable[..., Any], logits: Any, params: Any, repeats: int) -> float:
    return min(_call(step, (logits, params)) for _ in range(repeats))


def _alternately(
    step: Callable[..., Any], base: tuple[Any, ...], case: tuple[Any, ...], repeats: int
) -> tuple[float, float]:
    """(best time of ``case``, median ratio of ``case`` to ``base``), the two
    called in turn, each first in half the pairs (``_in_turn``): a slower
    or faster spell of the machine falls on both halves of a pair, and the
    median drops the pairs it split."""
    pairs = _in_turn(
        {"base": lambda: _call(step, base), "case": lambda: _call(step, case)}, 2 * repeats
    )
    return min(p["case"] for p in pairs), _median_ratio(pairs, "case", "base")


def render(report: SamplingReport) -> str:
    width = max(len(c.name) for c in report.cases)
    lines = [
        f"sampling: batch {report.batch}, vocabulary {report.vocabulary:,}",
        f"  a pass that only reads the logits (jnp.max): {report.read_ms:.2f} ms; timed in turn,"
        f" greedy {report.greedy_to_read:.2f}x it, temperature alone"
        f" {report.temperature_to_greedy:.2f}x greedy",
    ]
    if report.model is not None:
        m = report.model
        lines.append(
            f"  {m.model}'s own logits ({m.positions} positions along a text): read"
            f" {m.read_ms:.2f} ms, greedy {m.greedy_ms:.2f} ms ({m.greedy_to_read:.2f}x),"
            f" temperature alone {m.temperature_ms:.2f} ms ({m.temperature_to_greedy:.2f}x"
            f" greedy); softmax's normaliser {m.weigh_ms:.2f} ms (temperature alone"
            f" {m.temperature_to_weigh:.2f}x it)"
        )
    for c in report.cases:
        line = (
            f"  {c.name:<{width}}  {c.ms:8.1f} ms  {c.ratio_to_temperature:5.2f}x temperature alone"
        )
        if c.compared_with is not None:
            line += f"  {c.ratio_to_compared:6.3f}x {c.compared_with} (timed in turn)"
        lines.append(line)
    return "\n".join(lines)
