"""The engine: a loaded model, the KV pool and the compiled step, ready to run.

``Engine.run`` runs one ragged step for sequences the caller has allocated
pages for, and returns sampled tokens (the only device-to-host transfer of a
step). The engine is the scheduler's executor (kvd/sched/executor.py): it owns
the device pool and the compiled programs, not the KV bookkeeping; the block
tables it reads are those of the KV manager it is bound to.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
import structlog

from kvd import faults
from kvd.engine import heap, hugepages, onednn, qdense
from kvd.engine.attention import KEY_CHUNK
from kvd.engine.batching import (
    BIAS_WIDTH,
    SAMPLING_FLOATS,
    SAMPLING_INTS,
    SAMPLING_MIN_END,
    SAMPLING_PENALTIES,
    SAMPLING_PROMPT,
    SAMPLING_SCORE,
    SAMPLING_STOP,
    SAMPLING_TOP,
    SequenceRows,
    assemble_step_batch,
    batch_shapes,
    bucket,
    group_rings,
    pack,
    pack_decode_step,
    powers_of_two,
    sliding_ring,
    unpack,
)
from kvd.engine.config import MATMUL_CHOICES, EngineDefaults
from kvd.engine.kvquant import storage_dtype
from kvd.engine.loader import LoadedModel
from kvd.engine.lockstep import GATHER, SCATTER, STEP, STOP, Lockstep
from kvd.engine.model import (
    EngineSpec,
    Params,
    StepBatch,
    activation_dtype,
    body,
    final_norm,
    head,
    normed_logits,
    prepare_params,
)
from kvd.engine.sampling import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingBatch, sample
from kvd.engine.weight_args import WeightsJit
from kvd.kv.geometry import POOL_DTYPES, GeometryError, canonical_dtype
from kvd.kv.layout import build_layout
from kvd.kv.manager import KVManager, StepColumns
from kvd.kv.sequence import Sequence
from kvd.sched.constraint import mask_words
from kvd.sched.executor import ExecutorSizes, ParamsLookup, PromptScores, StepOutput

Progress = Callable[[int, int, str], None]


class EngineConfig(msgspec.Struct, frozen=True):
    dtype: str = EngineDefaults.DTYPE  # weights and activations
    kv_dtype: str | None = None  # None: the compute dtype
    block_size: int = EngineDefaults.BLOCK_SIZE
    max_model_len: int = EngineDefaults.MAX_MODEL_LEN
    max_num_seqs: int = EngineDefaults.MAX_NUM_SEQS
    max_num_batched_tokens: int = EngineDefaults.MAX_NUM_BATCHED_TOKENS
    pool_tokens: int = 65_536  # KV capacity, in tokens of a global layer group
    # Run same-shaped layers as one lax.scan: compiles several times faster,
    # but on XLA:CPU runs ~1.5x slower (the stacked weights are sliced per layer).
    scan_layers: bool = False
    # Devices the model is split over (kvd/engine/sharding.py).
    tensor_parallel: int = EngineDefaults.TENSOR_PARALLEL
    attention: str = EngineDefaults.ATTENTION  # kvd.engine.config.ATTENTION_CHOICES
    # The matrix products: "xla", "onednn" (bf16 on oneDNN's AMX/AVX-512
    # kernels, one CPU device only; kvd/engine/onednn.py) or "auto" (onednn
    # where it can run).
    matmul: str = "xla"


class EngineError(ValueError):
    pass


def run_body(
    spec: EngineSpec,
    max_seqs: int,
    params: Params,
    pool: jax.Array,
    flat: jax.Array,
    every: jax.Array,
    previous: jax.Array,
    *,
    tokens: int,
    width: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The decoder stack over a packed StepBatch, followed in ``flat`` by a
    source per token: -1, or the row of ``previous`` (the tokens the last
    step sampled, still on the device) that holds it, for a token the host
    has not read yet (an overlapped step). Returns the hidden states of
    the rows to sample through the final norm (``model.final_norm``), ``[S_max,
    D]``, the step's hidden states of every
    token written over the first rows of ``every`` (a donated ``[T_max, D]``
    buffer: one shape for every bucket, so the prompt-scoring program that
    reads it compiles once; rows past the step's hold stale values, never
    scored), and the pool."""
    groups = len(spec.group_places)
    shapes = batch_shapes(tokens, max_seqs, width, groups)
    *fields, source = unpack(flat, [*shapes, (tokens,)])
    batch = StepBatch(*fields)
    from_device = previous[jnp.maximum(source, 0)]
    batch = batch._replace(tokens=jnp.where(source < 0, batch.tokens, from_device))
    hidden, pool = body(spec, params, pool, batch)
    every = jax.lax.dynamic_update_slice(every, hidden.astype(every.dtype), (0, 0))
    return final_norm(spec, params, hidden[batch.sample_index]), every, pool


SCORE_ROWS = 16  # prompt positions whose logits ([16, V]) are computed at a time


def score_prompt(
    spec: EngineSpec, params: Params, hidden: jax.Array, targets: jax.Array, alternatives: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A prompt's own logprobs: for each token row of ``hidden [T, D]`` whose
    ``targets`` entry is a token id (-1: not scored), the logprob of that
    token (the prompt's next) and, when ``alternatives`` (a scalar) is not 0,
    the ``MAX_TOP_LOGPROBS`` likeliest tokens with theirs: ``[T]``, ``[T, K]``,
    ``[T, K]``, zeros elsewhere. The head runs over the scored rows alone,
    ``SCORE_ROWS`` at a time, so the logits of a long prompt never exist at
    once."""
    total = hidden.shape[0]
    chunk = min(SCORE_ROWS, total)
    groups = -(-total // chunk)
    scored = targets >= 0
    top = min(MAX_TOP_LOGPROBS, spec.config.vocab_size)
    empty = (
        jnp.zeros(total, jnp.float32),
        jnp.zeros((total, top), jnp.int32),
        jnp.zeros((total, top), jnp.float32),
    )

    def run() -> tuple[jax.Array, jax.Array, jax.Array]:
        (rows,) = jnp.nonzero(scored, size=groups * chunk, fill_value=total)

        def one_chunk(
            i: jax.Array, out: tuple[jax.Array, jax.Array, jax.Array]
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
            at = jax.lax.dynamic_slice(rows, (i * chunk,), (chunk,))
            clipped = jnp.minimum(at, total - 1)
            logits = head(spec, params, hidden[clipped])  # [chunk, V]
            normaliser = jax.nn.logsumexp(logits, axis=1)
            wanted = logits[jnp.arange(chunk), jnp.maximum(targets[clipped], 0)] - normaliser

            def best() -> tuple[jax.Array, jax.Array]:
                values, ids = jax.lax.top_k(logits, top)
                return ids.astype(jnp.int32), values - normaliser[:, None]

            ids, values = jax.lax.cond(
                alternatives > 0, best, lambda: (empty[1][:chunk], empty[2][:chunk])
            )
            logprobs, top_ids, top_values = out
            return (
                logprobs.at[at].set(wanted, mode="drop"),
                top_ids.at[at].set(ids, mode="drop"),
                top_values.at[at].set(values, mode="drop"),
            )

        trips = (jnp.sum(scored) + chunk - 1) // chunk
        return jax.lax.fori_loop(0, trips, one_chunk, empty)

    return jax.lax.cond(jnp.any(scored), run, lambda: empty)


def head_and_sample(
    spec: EngineSpec,
    end_ids: tuple[int, ...],
    params: Params,
    rows: jax.Array,
    ints: jax.Array,
    floats: jax.Array,
    history: jax.Array,
    allowed: jax.Array,
    previous: jax.Array,
    newest: jax.Array,
    bias: jax.Array,
    *,
    seqs: int,
) -> tuple[jax.Array, ...]:
    """Logits and sampling for the first S rows (``run_body``'s, already through
    the final norm), from packed sampling arrays
    (one ``SequenceRows`` sampling row per sequence), the token histories
    ``[S, H]`` (read only when a row has a penalty), the structured-output
    token bitmasks ``[S, W]`` (applied only when a row is not all ones), the
    logit bias rows ``[S, BIAS_WIDTH]`` (ids, then the biases' bits; -1 ids
    bias nothing), and
    per row the row of ``previous`` (the last step's sampled tokens) holding
    its newest token, which the host's history lacks while that step is in
    flight, or -1."""
    ints = ints.reshape(seqs, SAMPLING_INTS)
    floats = floats.reshape(seqs, SAMPLING_FLOATS)
    sampling = SamplingBatch(
        temperature=floats[:, 0],
        top_k=ints[:, 0],
        top_p=floats[:, 1],
        seeds=jax.lax.bitcast_convert_type(ints[:, 1], jnp.uint32),
        positions=ints[:, 2],
        stop_ids=ints[:, SAMPLING_STOP:],
        want_logprobs=ints[:, 3].astype(jnp.bool_),
        min_p=floats[:, 2],
        min_end=ints[:, SAMPLING_MIN_END],
        bias_ids=bias[:, :MAX_LOGIT_BIAS],
        biases=jax.lax.bitcast_convert_type(bias[:, MAX_LOGIT_BIAS:], jnp.float32),
        top_count=ints[:, SAMPLING_TOP],
        prompt_end=ints[:, SAMPLING_PROMPT],
        presence=floats[:, SAMPLING_PENALTIES],
        frequency=floats[:, SAMPLING_PENALTIES + 1],
        repetition=floats[:, SAMPLING_PENALTIES + 2],
        history=history,
        allowed=allowed,
        newest=jnp.where(newest >= 0, previous[jnp.maximum(newest, 0)], -1),
    )
    tokens, *rest = sample(normed_logits(spec, params, rows[:seqs]), sampling, end_ids)
    # Padded to every row, one shape whatever the bucket: the next step's
    # ``previous`` (run_body) reads them where they are.
    return (jnp.zeros(rows.shape[0], tokens.dtype).at[:seqs].set(tokens), *rest)


def _inject_step_fault() -> None:
    action = faults.fire("step")
    if action == "raise":
        raise faults.InjectedFault("injected: the engine step failed")
    if action == "hang":
        threading.Event().wait()  # a device that never answers
    if action == "slow":
        time.sleep(faults.SLOW_STEP_S)


def _warm_runs(tokens: int, seqs: int, reach: int) -> tuple[list[int], list[int]]:
    """(lengths, first positions) of the sequences of a warm-up step of
    ``tokens``: runs of tokens, each ending a few key chunks in, then a
    lone token, within ``seqs`` rows and ``reach`` positions each (what the
    table and ``max_model_len`` allow); what does not fit is padding."""
    last = min(reach, 4 * KEY_CHUNK) - 1
    if tokens == 1 or seqs == 1:
        lengths = [min(tokens, reach)]
    else:
        lengths, left = [], tokens - 1
        while left > 0 and len(lengths) < seqs - 1:
            lengths.append(min(left, reach))
            left -= lengths[-1]
        lengths.append(1)
    return lengths, [max(0, last + 1 - n) for n in lengths]


def _place_in_place(tree: Any) -> Any:
    """Put every array of a nest of dicts and lists on the device, replacing
    it where it was (so no one keeps the host copy alive); returns the nest."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in list(items):
        if isinstance(value, dict | list):
            _place_in_place(value)
        else:
            tree[key] = jax.block_until_ready(jax.device_put(value))  # an array or a QuantWeight
    return tree


def _place_sharded(params: Any, shardings: Any) -> Any:
    """The weights placed by ``shardings`` (a prefix of their tree). Under
    several processes each process makes only its own devices' shards from
    its host copy: ``device_put`` would first all-gather every weight to
    check that the processes agree (a 31B model's embedding, several times
    over, on every device)."""
    if jax.process_count() == 1:
        return jax.device_put(params, shardings)

    def place(sharding: Any, subtree: Any) -> Any:
        def one(array: Any) -> Any:
            host = np.asarray(array)
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

        return jax.tree.map(one, subtree)

    return jax.tree.map(place, shardings, params)


def engine_kv_dtype(name: str) -> str:
    """The canonical pool dtype for ``name``, or EngineError naming what is supported."""
    try:
        dtype = canonical_dtype(name)
    except GeometryError as exc:
        raise EngineError(str(exc)) from None
    if dtype not in POOL_DTYPES:
        raise EngineError(f"KV dtype {name!r} is not supported (use {', '.join(POOL_DTYPES)})")
    return dtype


class _LaterRows:
    """Pages gathered on the device, read on the host when first needed."""

    def __init__(self, data: Any, count: int) -> None:
        self._data, self._count = data, count
        self._rows: np.ndarray[Any, Any] | None = None

    def __len__(self) -> int:
        return self._count

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray[Any, Any]:
        if self._rows is None:
            self._rows = np.asarray(self._data)[: self._count].reshape(self._count, -1)
            self._data = None
        return self._rows if dtype is None else self._rows.astype(dtype)

    def __getitem__(self, index: int) -> Any:
        return np.asarray(self)[index]


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig | None = None) -> None:
        """Size the pool, place weights and pool on the devices, choose the
        shape buckets and set up the programs (compiled by ``warm_up``).
        The order matters: the pool is placed after the weights, to keep the
        peak memory down."""
        self.model = model
        self.config = cfg = config or EngineConfig()
        kv_dtype = self._size(model, cfg)
        params = prepare_params(self.spec, model.params) if cfg.scan_layers else model.params
        pool_sharding = self._place(model, cfg, params, kv_dtype)
        self.matmul = self._choose_matmul(cfg)
        self.one_row_twin_bytes = self._add_one_row_twins(cfg)
        self._choose_buckets(model, cfg)
        self._jit_programs(cfg, model, pool_sharding)
        self._start_counters(cfg)

    def _size(self, model: LoadedModel, cfg: EngineConfig) -> str:
        """The layout, the pool's pages, the sliding rings and the model's
        spec; returns the pool's dtype."""
        if cfg.max_model_len > model.config.max_position:
            raise EngineError(
                f"max_model_len {cfg.max_model_len} exceeds the model's {model.config.max_position}"
            )
        kv_dtype = engine_kv_dtype(cfg.kv_dtype or cfg.dtype)
        self.layout = build_layout(model.config.kv_geometry(kv_dtype), cfg.block_size)
        # One more than the blocks: page 0 is the null page padding points at.
        self.num_pages = cfg.pool_tokens // cfg.block_size * self.layout.num_groups + 1
        self.vocab_size = model.config.vocab_size
        self._max_blocks = max_blocks = math.ceil(cfg.max_model_len / cfg.block_size)
        # Sliding groups' tables are rings over what one step can see; none
        # when that is the whole context anyway.
        ring = sliding_ring(self.layout, cfg.max_num_batched_tokens)
        self.sliding_ring = ring if ring < max_blocks else 0
        self.rings = group_rings(self.layout, self.sliding_ring)
        try:
            self.spec = EngineSpec.build(
                model.config, self.layout, self.sliding_ring, cfg.attention
            )
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        return kv_dtype

    def _place(self, model: LoadedModel, cfg: EngineConfig, params: Any, kv_dtype: str) -> Any:
        """Weights, then the pool, on the device (or split over the mesh);
        returns the pool's sharding (None on one device)."""
        pages = self.num_pages
        stored = storage_dtype(kv_dtype, jax.default_backend())
        elements = self.layout.page_bytes // stored.itemsize

        def zero_pool() -> jax.Array:
            return jnp.zeros((pages, elements), stored)

        self.mesh = None
        self._replicated = None
        if cfg.tensor_parallel > 1:
            from kvd.engine import sharding

            try:
                sharding.check_divisible(model.config, cfg.tensor_parallel)
                sharding.check_weight_blocks(params, cfg.tensor_parallel)
                sharding.check_processes(cfg.tensor_parallel)
                self.mesh = sharding.make_mesh(cfg.tensor_parallel)
            except sharding.ShardingError as exc:
                raise EngineError(str(exc)) from None
            param_sharding = sharding.param_shardings(model.config, params, self.mesh)
            self._replicated = sharding.replicated(self.mesh)
            self.params = _place_sharded(params, param_sharding)
            geometry = self.layout.geometry
            pool_shape, pool_sharding = sharding.pool_layout(
                model.config,
                (pages, elements),
                cfg.tensor_parallel,
                self.mesh,
                geometry.scale_bytes(geometry.kinds()[0]) // geometry.element_size,
            )
            # Made where it lives: no host copy of the pool, and under several
            # processes each makes only its own devices' shards.
            self.pool = jax.jit(
                lambda: jnp.zeros(pool_shape, stored), out_shardings=pool_sharding
            )()
            return pool_sharding
        if cfg.scan_layers:
            self.params = jax.device_put(params)
            self.pool = zero_pool()
            return None
        # Placed array by array, each host array let go once its device
        # copy exists: the weights are never held twice (on CPU a second
        # gigabyte for the 270M in f32). Engines built later from this model
        # share the device arrays.
        self.params = _place_in_place(model.params)
        # The pool after the weights: the peak holds one array twice, not the pool.
        self.pool = zero_pool()
        return None

    def _choose_matmul(self, cfg: EngineConfig) -> str:
        """The products the engine runs, xla or onednn; with onednn the
        placed weights gain their oneDNN forms (``onednn.prepare``)."""
        if cfg.matmul not in MATMUL_CHOICES:
            raise EngineError(f"matmul {cfg.matmul!r} is not one of {', '.join(MATMUL_CHOICES)}")
        if cfg.matmul == "xla":
            return "xla"
        single = self.mesh is None and not cfg.scan_layers and jax.process_count() == 1
        reason = onednn.unavailable_reason(jax.default_backend(), single)
        if reason is not None:
            if cfg.matmul == "onednn":
                raise EngineError(f"matmul onednn: {reason}")
            return "xla"
        try:
            self.params, self._onednn_slots = onednn.prepare(self.params)
        except onednn.OnednnError as exc:  # the library loaded but refused a call
            raise EngineError(f"matmul {cfg.matmul}: {exc}") from None
        weakref.finalize(self, onednn.REGISTRY.release, self._onednn_slots)
        return "onednn"

    def _add_one_row_twins(self, cfg: EngineConfig) -> int:
        """On XLA:CPU, int8 layer matrices gain a transposed twin for one-token
        steps (``qdense.OneRowTwin``); returns the bytes added."""
        one_device = self.mesh is None and jax.process_count() == 1
        if not qdense.keeps_one_row_twins(jax.default_backend(), one_device, cfg.scan_layers):
            return 0
        added = qdense.one_row_twin_bytes(self.model.params)  # a twin's bytes are its matrix's
        self.params = qdense.with_one_row_twins(self.params)
        return added

    def _choose_buckets(self, model: LoadedModel, cfg: EngineConfig) -> None:
        """The shapes programs compile for, and the device buffers sized by them."""
        # Shapes: the body compiles per (tokens, block-table width); the head and
        # sampling per number of sequences, so a lone decode pays for one row of
        # logits, not for the widest batch.
        # A lone decode runs in a bucket of one token. (It once ran in one of
        # two: a one-token step was several times slower, because XLA copied
        # the whole pool to write one token's K/V; see model._write_kv.)
        self.token_buckets = powers_of_two(1, max(2, cfg.max_num_batched_tokens))
        every_shape = (self.token_buckets[-1], model.config.hidden_size)
        self.seq_buckets = powers_of_two(1, cfg.max_num_seqs)
        # Host zeros, put by ``_put``'s rule (under several processes each
        # process puts its own shards of them).
        put = jnp.asarray if self._replicated is None else self._put
        self._every_hidden = put(np.zeros(every_shape, activation_dtype(self.params)))
        # The last dispatched step's sampled tokens, on the device: the next
        # step reads a row's newest token there when the host has not yet.
        self._previous = put(np.zeros(cfg.max_num_seqs, np.int32))
        # The reference attention's cost follows the live keys whatever the
        # tables' width, so it compiles one width (each program costs ~0.1 GB of
        # resident code on XLA:CPU); the kernel's grid walks the whole table, so
        # it gets narrower buckets. Every width holds a sliding ring: those
        # tables are its first entries.
        max_blocks = self._max_blocks
        widths: tuple[int, ...] = (max_blocks,)
        if self.spec.attention != "reference":
            widths = (max_blocks // 16, max_blocks // 4, max_blocks)
        self.block_buckets = tuple(sorted({max(1, self.sliding_ring, b) for b in widths}))
        # Swapping: pages gathered to the host and scattered back. Padding a copy
        # costs little, so the page-count buckets grow by 4x (fewer programs).
        # A sequence mid-prefill holds a chunk past its windows: the most it can hold.
        most = max(16, self.layout.pages_for_tokens(cfg.max_model_len, cfg.max_num_batched_tokens))
        self.page_buckets = tuple(
            sorted({*(16 * 4**i for i in range(8) if 16 * 4**i < most), most})
        )

    def _jit_programs(self, cfg: EngineConfig, model: LoadedModel, pool_sharding: Any) -> None:
        """The step's programs (body, head and sampling), prompt scoring and the
        page copies, traced lazily and compiled per bucket."""
        # With tensor parallelism the programs are compiled for the mesh. Their
        # inputs carry their shardings (weights and pool are placed above, host
        # buffers are put replicated by ``_put``: jit does not take
        # in_shardings together with the static shape keywords); their outputs
        # are given explicitly.
        shardings: dict[str, Any] = {}
        head_shardings: dict[str, Any] = {}
        copy_shardings: dict[str, Any] = {}
        everywhere = self._replicated
        if everywhere is not None:
            shardings = {"out_shardings": (everywhere, everywhere, pool_sharding)}
            head_shardings = {"out_shardings": everywhere}
            copy_shardings = {"out_shardings": pool_sharding}
        self._body = WeightsJit(
            partial(run_body, self.spec, cfg.max_num_seqs),
            static_argnames=("tokens", "width"),
            donate_argnums=(1, 3),
            **shardings,
        )
        tokenizer = model.tokenizer
        # EOS and end-of-turn end every generation (no tokenizer: a bare model in tests).
        self.stop_ids = tokenizer.stop_ids() if tokenizer is not None else frozenset()
        self._head = WeightsJit(
            partial(head_and_sample, self.spec, tuple(sorted(self.stop_ids))),
            static_argnames=("seqs",),
            **head_shardings,
        )
        self._score = WeightsJit(partial(score_prompt, self.spec), **head_shardings)
        # Under several processes the leader reads every shard of a copy (each
        # host's shards travel to it), so the gather's result is replicated.
        gather_shardings = {} if jax.process_count() == 1 else head_shardings
        self._gather = jax.jit(lambda pool, pages: pool[pages], **gather_shardings)
        self._scatter = jax.jit(
            lambda pool, pages, data: pool.at[pages].set(data),
            donate_argnums=(0,),
            **copy_shardings,
        )

    def _start_counters(self, cfg: EngineConfig) -> None:
        # Compiled executables by shape key; warm-up fills them ahead of time.
        self._programs: dict[tuple[str, int, int], Any] = {}
        self.late_compiles = 0  # programs compiled after warm_up(): a bucketing bug
        self.device_seconds = 0.0  # time in device programs and their results, all steps
        self.last_read_at = 0.0  # when a step's results were last read (perf_counter)
        # Steps of decodes alone: their tokens and wall time (host work included),
        # for decode throughput that no prefill in the same run can blur.
        self.decode_tokens = 0
        self.decode_seconds = 0.0
        self._warm = False
        self.huge_page_bytes = 0  # the weights and pool on huge pages (hugepages.py)
        self._rows = self._new_rows()
        self._minus_ones: dict[tuple[int, ...], Any] = {}  # by shape (``_constant``)
        self.mask_words = mask_words(self.vocab_size)
        # Under several processes: the leader sends each device call, the
        # others replay it (``follow``).
        self.lockstep = Lockstep(self._largest_message()) if jax.process_count() > 1 else None
        self._table_edits: list[tuple[int, int, int, int]] = []
        self.kv: KVManager | None = None  # whose tables the steps read (``bind``)
        self.limits = ExecutorSizes(
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            vocab_size=self.vocab_size,
            token_buckets=self.token_buckets,
            max_copy_pages=self.page_buckets[-1],
        )

    def bind(self, kv: KVManager) -> None:
        """Read block tables from ``kv`` from now on. The per-sequence rows
        cached for the device start over: they were keyed by another manager's
        sequences."""
        if kv.layout != self.layout or kv.num_pages != self.num_pages:
            raise EngineError("the KV manager's layout or pool size is not this engine's")
        self.kv = kv
        self._rows = self._new_rows()
        self._table_edits = kv.log_table_edits()
        self._table_edits.clear()

    def _new_rows(self) -> SequenceRows:
        return SequenceRows(
            self.layout.num_groups, self._max_blocks, self.rings, self.config.max_model_len
        )

    def _histories(
        self, rows: np.ndarray[Any, Any], seqs: list[Sequence], ends: np.ndarray[Any, Any]
    ) -> np.ndarray[Any, Any] | None:
        """The head's token histories for ``rows`` (a sequence bucket's); None
        when no row has a penalty (the device's constant stands in)."""
        if self._rows.any_penalized(rows[: len(seqs)]):
            return self._rows.histories(rows, seqs, ends)
        return None

    def _masks(
        self, seqs_bucket: int, masks: np.ndarray[Any, Any] | None
    ) -> np.ndarray[Any, Any] | None:
        """The head's token bitmasks for a sequence bucket: the step's, padded
        with all-ones rows; None when no row has a grammar."""
        if masks is None:
            return None
        padded = np.full((seqs_bucket, self.mask_words), -1, np.int32)
        padded[: len(masks)] = masks
        return padded

    def _constant(self, shape: tuple[int, ...]) -> Any:
        """An int32 device array of -1s of ``shape``, made once: the head's
        input for a step no row of which has a penalty (empty histories) or a
        grammar (all-ones bitmasks), so nothing is sent per step."""
        array = self._minus_ones.get(shape)
        if array is None:
            array = self._put(np.full(shape, -1, np.int32))
            self._minus_ones[shape] = array
        return array

    def barrier(self) -> None:
        """Wait for every dispatched program (a copy-in returns before it lands)."""
        self.pool.block_until_ready()

    # -- shapes ----------------------------------------------------------------------

    def _rows_spec(self) -> jax.ShapeDtypeStruct:
        """The decoder's output for the head: one row per possible sequence."""
        hidden = self.model.config.hidden_size
        return self._spec((self.config.max_num_seqs, hidden), activation_dtype(self.params))

    def _largest_message(self) -> int:
        """The most int32 words one lockstep payload carries: a step of the
        largest buckets, or a copy of the most pages."""
        cfg, seqs = self.config, self.config.max_num_seqs
        tokens, width = self.token_buckets[-1], self.block_buckets[-1]
        flat = tokens + sum(
            math.prod(shape) for shape in batch_shapes(tokens, seqs, width, self.layout.num_groups)
        )
        per_seq = SAMPLING_INTS + SAMPLING_FLOATS + BIAS_WIDTH + 1
        step = flat + seqs * (per_seq + cfg.max_model_len + self.mask_words) + tokens + 1
        pages = self.page_buckets[-1]
        copy = pages + pages * self.layout.page_bytes // 4
        return max(step, copy) + 16

    def _put(self, array: np.ndarray[Any, Any]) -> Any:
        """A host buffer for a compiled program: replicated over the mesh, if any.

        On one device the buffer goes as it is: the compiled call transfers it
        in C++, about 0.1 ms cheaper per buffer than a device_put from Python.
        """
        if self._replicated is None:
            return array
        if jax.process_count() > 1:
            # Every process passes the same buffer (the lockstep sees to it):
            # device_put would check that with a blocking all-gather per buffer.
            return jax.make_array_from_process_local_data(self._replicated, array, array.shape)
        return jax.device_put(array, self._replicated)

    def _spec(self, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self._replicated)

    def bytes_here(self) -> dict[str, int]:
        """What this process's devices hold, in bytes: the weights and the
        pool (each device's copy or shard counted). Under several processes
        each host holds its own share; on one process, all of it."""

        def here(array: Any) -> int:
            return sum(shard.data.nbytes for shard in array.addressable_shards)

        weights = sum(here(leaf) for leaf in jax.tree.leaves(self.params))
        return {
            "processes": jax.process_count(),
            "weight_bytes_per_host": weights,
            "pool_bytes_per_host": here(self.pool),
        }

    def page_elements(self) -> int:
        return math.prod(self.pool.shape[1:])

    def copy_out(self, pages: list[int]) -> np.ndarray[Any, Any]:
        """The contents of ``pages``, on the host: ``[len(pages), E]`` (flat
        pages, whatever the pool's layout)."""
        return np.asarray(self.copy_out_later(pages))

    def copy_out_later(self, pages: list[int]) -> Any:
        """``copy_out`` without waiting: the gather is dispatched (ordered
        before any later step that overwrites those pages) and its result
        starts moving to the host; ``np.asarray`` on what is returned waits
        for it. The host cache's offloads use this, so a step does not wait
        for the copies of the pages it is about to reuse."""
        if faults.fire("d2h") == "fail":
            raise faults.InjectedFault("injected: a device-to-host copy failed")
        size = bucket(len(pages), self.page_buckets)
        index = np.pad(np.asarray(pages, np.int32), (0, size - len(pages)))
        self._send(GATHER, (), (index,))
        data = self._launch_gather(index)
        data.copy_to_host_async()
        return _LaterRows(data, len(pages))

    def _launch_gather(self, index: np.ndarray[Any, Any]) -> Any:
        size = len(index)
        device_index = self._put(index)
        program = self._program(("gather", size, 0), self._gather, self.pool, device_index)
        return program(self.pool, device_index)

    def copy_in(self, pages: list[int], data: np.ndarray[Any, Any]) -> None:
        """Write host ``data`` into ``pages`` (padding lands in the null page)."""
        size = bucket(len(pages), self.page_buckets)
        index = np.pad(np.asarray(pages, np.int32), (0, size - len(pages)))
        padded = np.zeros((size, self.page_elements()), self.pool.dtype)
        padded[: len(pages)] = data
        self._send(SCATTER, (), (index, padded))
        self._launch_scatter(index, padded)

    def _launch_scatter(self, index: np.ndarray[Any, Any], values: np.ndarray[Any, Any]) -> None:
        size = len(index)
        device_index = self._put(index)
        device_values = self._put(values.reshape(size, *self.pool.shape[1:]))
        program = self._program(
            ("scatter", size, 0), self._scatter, self.pool, device_index, device_values
        )
        self.pool = program(self.pool, device_index, device_values)

    # -- several processes -----------------------------------------------------------

    def _send(self, op: int, statics: tuple[int, ...], arrays: tuple[Any, ...]) -> None:
        """The leader, before a device call: every follower makes the same one."""
        if self.lockstep is not None and self.lockstep.leader:
            self.lockstep.send(op, statics, arrays)

    @property
    def follower(self) -> bool:
        return self.lockstep is not None and not self.lockstep.leader

    def follow(self) -> None:
        """A follower's life after warm-up: replay the leader's device calls in
        its order until it sends ``stop``. Results are the leader's to read."""
        if not self.follower:
            raise EngineError("only a follower process follows the leader")
        assert self.lockstep is not None
        log = structlog.get_logger("kvd.engine")
        while True:
            message = self.lockstep.receive()
            if message.op == STEP:
                tokens, width, seqs = message.statics
                self._launch_step(tokens, width, seqs, *message.arrays)
            elif message.op == GATHER:
                self._launch_gather(*message.arrays)
            elif message.op == SCATTER:
                self._launch_scatter(*message.arrays)
            elif message.op == STOP:
                self.barrier()
                log.info("distributed.stopped", process=self.lockstep.process)
                return
            else:
                raise EngineError(f"the leader sent an unknown operation {message.op}")

    def stop_followers(self) -> None:
        """The leader at shutdown: the followers' ``follow`` returns."""
        if self.lockstep is not None and self.lockstep.leader:
            # Waited for: every follower has its stop before the leader leaves.
            jax.block_until_ready(self.lockstep.send(STOP, ()))
            self.barrier()

    def shape_buckets(self) -> list[tuple[int, int]]:
        return [(t, w) for t in self.token_buckets for w in self.block_buckets]

    def compiled_shapes(self) -> int:
        """How many programs exist (a compile after warm-up shows up here and in
        ``late_compiles``)."""
        return len(self._programs)

    def _program(self, key: tuple[str, int, int], jitted: Any, *args: Any, **static: Any) -> Any:
        program = self._programs.get(key)
        if program is None:
            # Ahead-of-time: compile without running (the persistent cache makes
            # this a disk read on a restart).
            if isinstance(jitted, WeightsJit):  # the first argument is the weights
                program = jitted.compile(*args, **static)
            else:
                program = jitted.lower(*args, **static).compile()
            self._programs[key] = program
            if self._warm:  # a shape no bucket covers: a bug worth an operator's eye
                self.late_compiles += 1
                structlog.get_logger("kvd.engine").warning(
                    "engine.late_compile", program=key[0], shape=list(key[1:])
                )
        return program

    def warm_up(self, progress: Progress | None = None) -> float:
        """Compile every bucket before serving; returns seconds spent."""
        start = time.perf_counter()
        shapes = self.shape_buckets()
        total = len(shapes) + len(self.seq_buckets) + 1
        for done, (tokens, width) in enumerate(shapes, 1):
            self._body_program(tokens, width)
            if progress is not None:
                progress(done, total, f"decoder: {tokens} tokens, {width} blocks")
        for done, seqs in enumerate(self.seq_buckets, len(shapes) + 1):
            self._head_program(seqs)
            if progress is not None:
                progress(done, total, f"head and sampling: {seqs} sequences")
        self._score_program()
        if progress is not None:
            progress(total - 1, total, "prompt logprobs")
        for size in self.page_buckets:  # swap copies: small programs, all of them
            index = self._spec((size,), jnp.int32)
            values = self._spec((size, *self.pool.shape[1:]), self.pool.dtype)
            self._program(("gather", size, 0), self._gather, self.pool, index)
            self._program(("scatter", size, 0), self._scatter, self.pool, index, values)
        if progress is not None:
            progress(total, total, f"swap copies: up to {self.page_buckets[-1]} pages")
        if self.lockstep is not None:
            self.lockstep.compile()  # the messages that carry each call to the followers
            self.lockstep.meet("compiled")  # every process compiled: the collectives may start
        self._first_runs(shapes)
        if self.lockstep is not None:  # the leader's first message finds every follower there
            self.lockstep.meet("warm")
        heap.release_free_memory()  # compiling leaves hundreds of MB freed but resident
        # Every step reads the weights (and the pool) through the TLB: on
        # huge pages a batch-1 token took 13.6-14.1 ms against 14.6-15.4.
        self.huge_page_bytes = hugepages.back_with_huge_pages(
            [*jax.tree_util.tree_leaves(self.params), self.pool]
        )
        self._warm = True
        return time.perf_counter() - start

    def _first_runs(self, shapes: list[tuple[int, int]]) -> None:
        """Run every decoder program once: a program's first run pays for its
        buffers' first page faults, its threads' start and XLA:CPU's
        first-use set-up of its fused kernels, which the first requests would
        otherwise pay (a 128-token prefill took 0.36 s, then 0.25 s). The
        batch is live tokens whose every block is the null page (all-zero
        tables), so they write only there; a run of tokens and a lone one at
        positions a few key chunks in, so that both of attention's loops run:
        a loop that never iterates leaves its body's kernels cold (the first
        prefix-cache hit's 64-token step took 0.19 s, the next 0.13)."""
        groups, seqs = self.layout.num_groups, self.config.max_num_seqs
        block = self.layout.block_size
        for tokens, width in shapes:
            tables = np.zeros((groups, seqs, width), np.int32)
            reach = min(width * block, self.config.max_model_len)
            lengths, starts = _warm_runs(tokens, seqs, reach)
            batch = assemble_step_batch(
                np.zeros(sum(lengths), np.int32), starts, lengths, tables, block, tokens
            )
            flat = pack([*batch, np.full(tokens, -1, np.int32)])
            hidden, self._every_hidden, self.pool = self._body_program(tokens, width)(
                self.params, self.pool, self._put(flat), self._every_hidden, self._previous
            )
        hidden.block_until_ready()

    def _body_program(self, tokens: int, width: int) -> Any:
        program = self._programs.get(("body", tokens, width))
        if program is not None:  # every step after warm-up
            return program
        size = tokens + sum(  # the batch, then each token's source (run_body)
            math.prod(shape)
            for shape in batch_shapes(
                tokens, self.config.max_num_seqs, width, self.layout.num_groups
            )
        )
        flat = self._spec((size,), jnp.int32)
        return self._program(
            ("body", tokens, width),
            self._body,
            self.params,
            self.pool,
            flat,
            self._every_hidden,
            self._previous,
            tokens=tokens,
            width=width,
        )

    def _head_program(self, seqs: int) -> Any:
        program = self._programs.get(("head", seqs, 0))
        if program is not None:
            return program
        ints = self._spec((seqs * SAMPLING_INTS,), jnp.int32)
        floats = self._spec((seqs * SAMPLING_FLOATS,), jnp.float32)
        history = self._spec((seqs, self.config.max_model_len), jnp.int32)
        allowed = self._spec((seqs, self.mask_words), jnp.int32)
        previous = self._spec((self.config.max_num_seqs,), jnp.int32)
        newest = self._spec((seqs,), jnp.int32)
        bias = self._spec((seqs, BIAS_WIDTH), jnp.int32)
        return self._program(
            ("head", seqs, 0),
            self._head,
            self.params,
            self._rows_spec(),
            ints,
            floats,
            history,
            allowed,
            previous,
            newest,
            bias,
            seqs=seqs,
        )

    def _score_program(self) -> Any:
        program = self._programs.get(("score", 0, 0))
        if program is not None:
            return program
        targets = self._spec((self.token_buckets[-1],), jnp.int32)
        alternatives = self._spec((), jnp.int32)
        return self._program(
            ("score", 0, 0), self._score, self.params, self._every_hidden, targets, alternatives
        )

    # -- one step ------------------------------------------------------------------------

    def run(
        self,
        seqs: list[Sequence],
        counts: list[int],
        params: ParamsLookup,
        slots: np.ndarray[Any, Any],
        before: StepColumns,
        masks: np.ndarray[Any, Any] | None = None,
    ) -> StepOutput:
        """``dispatch`` a step and wait for what it sampled."""
        return self.dispatch(seqs, counts, params, slots, before, masks).result()

    def dispatch(
        self,
        seqs: list[Sequence],
        counts: list[int],
        params: ParamsLookup,
        slots: np.ndarray[Any, Any],
        before: StepColumns,
        masks: np.ndarray[Any, Any] | None = None,
        sources: np.ndarray[Any, Any] | None = None,
    ) -> EngineStep:
        """Start computing ``counts[i]`` tokens of ``seqs[i]`` (pages already
        allocated) and return at once: the step's ``result()`` is what each
        sampled (the alternatives only when one asked). ``slots``: the
        sequences' ``kv.slots_of``, ``before`` their columns before the step
        (``kv.step_columns(slots)``); ``masks``: structured output's
        token bitmasks, a row per sequence, or None; ``sources``: per
        sequence, the row of the step dispatched last whose sampled token is
        this sequence's newest (a placeholder on the host; it computes one
        token), or -1. The caller commits the tokens.

        A sequence's sampling parameters are read when it first runs (only
        those entries of ``params`` are looked at) and kept for its life.
        """
        entered = time.perf_counter()
        _inject_step_fault()
        count = len(seqs)
        if count > self.config.max_num_seqs:
            raise EngineError(f"{count} sequences exceed max_num_seqs {self.config.max_num_seqs}")
        if self.kv is None:
            raise EngineError("bind a KV manager before running a step")
        starts = before.computed
        total = sum(counts)
        decodes = total == count and bool((before.length == starts + 1).all())
        tokens_bucket = bucket(total, self.token_buckets)
        seqs_bucket = bucket(count, self.seq_buckets)
        width = bucket(int(before.blocks.max()), self.block_buckets)
        cache = self._rows
        rows = np.zeros(self.config.max_num_seqs, np.int64)
        rows[:count] = cache.prepare(
            seqs, slots, params, before.table_version, before.serial, self._table_edits
        )
        tables = cache.tables[:, rows, :width]
        if decodes:  # each computes its newest token: the most common step by far
            flat = pack_decode_step(
                before.last_token,
                starts,
                tables,
                self.layout.block_size,
                tokens_bucket,
                self.rings,
                tail=tokens_bucket,  # each token's source (run_body)
            )
            source = flat[-tokens_bucket:]
            source[:] = -1
            if sources is not None:
                source[:count] = sources
            ends = starts + 1
        else:
            tokens = [
                t
                for seq, start, n in zip(seqs, starts.tolist(), counts, strict=True)
                for t in seq.tokens[start : start + n]
            ]
            batch = assemble_step_batch(
                tokens, starts, counts, tables, self.layout.block_size, tokens_bucket, self.rings
            )
            source = np.full(tokens_bucket, -1, np.int32)
            if sources is not None:  # such a row computes one token: its newest
                offsets = np.cumsum(counts) - np.asarray(counts)
                source[offsets] = sources
            flat = pack([*batch, source])
            ends = batch.positions[batch.sample_index[:count]] + 1
        scoring = None if decodes else self._prompt_targets(seqs, counts, starts, rows[:count])
        ints, floats = cache.sampling(rows[:seqs_bucket], ends)
        newest = None
        if sources is not None:
            newest = np.full(seqs_bucket, -1, np.int32)
            newest[:count] = sources
        targets = most = None
        if scoring is not None:
            targets = np.full(self.token_buckets[-1], -1, np.int32)
            targets[: len(scoring[0])] = scoring[0]
            most = np.asarray(max(span[4] for span in scoring[1]), np.int32)
        inputs = (
            flat,
            newest,
            ints,
            floats,
            self._histories(rows[:seqs_bucket], seqs, ends),
            self._masks(seqs_bucket, masks),
            cache.biases(rows[:seqs_bucket], count),
            targets,
            most,
        )
        started = time.perf_counter()
        self._send(STEP, (tokens_bucket, width, seqs_bucket), inputs)
        sampled, logprobs, top_ids, top_logprobs, scores = self._launch_step(
            tokens_bucket, width, seqs_bucket, *inputs
        )
        # Prompt scores read this step's hidden states, which the next step's
        # body overwrites: their program is dispatched with the step's.
        prompt = None if scoring is None else partial(_prompt_scores, scores, scoring[1], count)
        top = None
        if cache.want_top(rows[:count]):  # only then is the result read
            top = top_ids, top_logprobs
        return EngineStep(self, count, sampled, logprobs, top, prompt, decodes, entered, started)

    def _launch_step(
        self,
        tokens_bucket: int,
        width: int,
        seqs_bucket: int,
        flat: np.ndarray[Any, Any],
        newest: np.ndarray[Any, Any] | None,
        ints: np.ndarray[Any, Any],
        floats: np.ndarray[Any, Any],
        history: np.ndarray[Any, Any] | None,
        allowed: np.ndarray[Any, Any] | None,
        bias: np.ndarray[Any, Any] | None,
        targets: np.ndarray[Any, Any] | None,
        most: np.ndarray[Any, Any] | None,
    ) -> tuple[Any, Any, Any, Any, Any]:
        """A step's device programs from its host inputs (what the leader
        sends its followers): the decoder, the head and sampling, and the
        prompt's scores when ``targets`` are given. None stands for a constant
        made once on the device (no penalties, no grammar, no placeholders,
        no logit biases)."""
        body_program = self._body_program(tokens_bucket, width)
        head_program = self._head_program(seqs_bucket)
        hidden, self._every_hidden, self.pool = body_program(
            self.params, self.pool, self._put(flat), self._every_hidden, self._previous
        )
        sampled, logprobs, top_ids, top_logprobs = head_program(
            self.params,
            hidden,
            self._put(ints),
            self._put(floats),
            self._device(history, (seqs_bucket, self.config.max_model_len)),
            self._device(allowed, (seqs_bucket, self.mask_words)),
            self._previous,
            self._device(newest, (seqs_bucket,)),
            self._device(bias, (seqs_bucket, BIAS_WIDTH)),
        )
        self._previous = sampled
        scores = None
        if targets is not None and most is not None:
            program = self._score_program()
            scores = program(self.params, self._every_hidden, self._put(targets), self._put(most))
        return sampled, logprobs, top_ids, top_logprobs, scores

    def _device(self, array: np.ndarray[Any, Any] | None, shape: tuple[int, ...]) -> Any:
        """``array`` for a program, or the constant of -1s of ``shape`` if None."""
        return self._constant(shape) if array is None else self._put(array)

    def _prompt_targets(
        self,
        seqs: list[Sequence],
        counts: list[int],
        starts: np.ndarray[Any, Any],
        rows: np.ndarray[Any, Any],
    ) -> tuple[np.ndarray[Any, Any], list[tuple[int, int, int, int, int]]] | None:
        """For the sequences whose prompt's own logprobs were asked and whose
        chunk this step holds prompt positions with a next prompt token:
        each token's target (the next token, -1 elsewhere) in the step's
        flattened order, and (sequence, offset, first position, count,
        alternatives) per span. None: no sequence asks (nearly every step)."""
        wanted = self._rows.ints[rows, SAMPLING_SCORE]
        if not (wanted >= 0).any():
            return None
        offsets = np.cumsum(counts) - np.asarray(counts)
        targets = np.full(int(sum(counts)), -1, np.int32)
        spans = []
        for i in np.flatnonzero(wanted >= 0).tolist():
            start = int(starts[i])
            prompt_end = int(self._rows.ints[rows[i], SAMPLING_PROMPT])
            stop = min(start + counts[i], prompt_end - 1)  # the last prompt token has no next
            if stop > start:
                offset = int(offsets[i])
                targets[offset : offset + stop - start] = seqs[i].tokens[start + 1 : stop + 1]
                spans.append((i, offset, start, stop - start, int(wanted[i])))
        return (targets, spans) if spans else None


def _prompt_scores(
    arrays: tuple[Any, Any, Any], spans: list[tuple[int, int, int, int, int]], count: int
) -> list[PromptScores | None]:
    """The prompt scores of ``spans`` from the scoring program's results."""
    logprobs, top_ids, top_values = (np.asarray(a) for a in arrays)
    scores: list[PromptScores | None] = [None] * count
    for i, offset, start, n, k in spans:
        at = slice(offset, offset + n)
        top = None
        if k:
            top = [
                tuple(zip(ids[:k].tolist(), values[:k].tolist(), strict=True))
                for ids, values in zip(top_ids[at], top_values[at], strict=True)
            ]
        scores[i] = PromptScores(start + 1, logprobs[at].tolist(), top)
    return scores


class EngineStep:
    """A dispatched step: its device results, read on ``result()``."""

    def __init__(
        self,
        engine: Engine,
        count: int,
        sampled: Any,
        logprobs: Any,
        top: tuple[Any, Any] | None,
        prompt: Callable[[], list[PromptScores | None]] | None,
        decodes: bool,
        entered: float,
        started: float,
    ) -> None:
        self._engine = engine
        self._count = count
        self._arrays = sampled, logprobs, top, prompt
        self._decodes = decodes
        self._entered, self._started = entered, started

    def result(self) -> StepOutput:
        """What each sequence sampled (waits for the device)."""
        sampled, logprobs, top, prompt = self._arrays
        count, engine = self._count, self._engine
        tokens, logprobs = np.asarray(sampled)[:count], np.asarray(logprobs)[:count]
        top_ids = top_logprobs = None
        if top is not None:
            top_ids, top_logprobs = np.asarray(top[0])[:count], np.asarray(top[1])[:count]
        scores = None if prompt is None else prompt()
        done = time.perf_counter()
        # The device runs steps in order: this one began at its dispatch or
        # when the one before it was read, whichever came later.
        engine.device_seconds += done - max(self._started, engine.last_read_at)
        engine.last_read_at = done
        if self._decodes:
            engine.decode_tokens += count
            engine.decode_seconds += done - self._entered
        return StepOutput(tokens, logprobs, top_ids, top_logprobs, scores)
