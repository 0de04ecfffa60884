"""The model's matrix products on oneDNN's bf16 kernels (Intel AMX, or
AVX-512 BF16), for XLA:CPU, which has no fast path for either.

On this project's CPU (a Xeon with AMX) XLA:CPU's f32 products run the
270M's output projection (262,144 x 640) at 32 rows in ~73 ms, and its bf16
and int8 products are slower still (~220 and ~430 ms); oneDNN's AMX kernel
does the same product in bf16 in ~19 ms, and the 18 layers' products at 32
rows in a fraction of XLA's ~58 ms. vLLM's CPU backend serves through the
same library. The cost is precision: activations and weights are rounded to
bf16 (vLLM's CPU numbers), where ``xla`` keeps f32 activations and the
weights' exact values. ``model.matmul`` chooses.

How the products reach oneDNN: each is a ``jax.pure_callback`` into this
module, which calls the library through ctypes (no build step: the library
comes from PyPI's ``onednn-cpu-gomp`` wheel). A callback costs 0.25 to 0.5
ms in jax's machinery (each operand converted, each result copied back), so
a layer's products that read the same input (q, k, v; gate, up) share one.
The weights never cross the callback: they live here, converted once at
load, and a program passes only their slot (an int32 jit argument, so the
layers still share one trace). Passing the matrices themselves would copy
them at every call (jax hands callbacks copies: 170 ms a step).

Small products keep XLA's: a step's output projection below
``HEAD_MIN_ROWS`` rows (one row of int8 weights streams half of bf16's
bytes, and there every product waits on memory), and the layers' products
below ``LAYER_MIN_ROWS`` tokens, where a callback's fixed cost (~0.5 ms in
a real step, 73 of them) outweighs what oneDNN saves: measured on the 270M
at context 464, oneDNN for the head alone decoded 90 tok/s at batch 8
against 76 with the layers' products too (XLA alone: 76), and 153 against
156 at batch 32; prefill chunks (hundreds of tokens) gain in full.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import sys
import threading
import weakref
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvd.engine.wquant import QuantWeight, dequantize, matrix_shape

# Rows from which a product goes to oneDNN (see the module's docstring; at
# one row XLA's fused int8 output projection takes ~5 ms, bf16's ~13-17).
HEAD_MIN_ROWS = 4
LAYER_MIN_ROWS = 64

# oneDNN's C API constants (dnnl_types.h, oneDNN 3.x).
_CPU = 1
_IN_ORDER = 1
_BF16, _F32 = 2, 3
_ANY, _AB = 1, 3
_QUERY_WEIGHTS_MD = 131
_ARG_SRC, _ARG_DST, _ARG_WEIGHTS = 1, 17, 33
_ALLOCATE = ctypes.c_void_p(-1 & (2**64 - 1))
_Dims = ctypes.c_int64 * 12

_LIBRARY = "libdnnl.so.3"


class OnednnError(RuntimeError):
    """oneDNN cannot run here, or a call failed; the message says why."""


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", ctypes.c_void_p)]


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _library_path() -> Path | None:
    """libdnnl from the onednn-cpu-gomp wheel (installed under the
    environment's ``lib/``), or None."""
    for prefix in (sys.prefix, sys.base_prefix):
        candidate = Path(prefix) / "lib" / _LIBRARY
        if candidate.exists():
            return candidate
    return None


def unavailable_reason(backend: str = "cpu", single_device: bool = True) -> str | None:
    """Why oneDNN's bf16 products cannot run here, or None when they can:
    for an engine on JAX's ``backend``, over one device (no tensor
    parallelism, one process) or not."""
    if backend != "cpu":
        return f"oneDNN products are for the CPU; this backend is {backend}"
    if not single_device:
        return "oneDNN products run on one CPU device, with unstacked layers"
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return "oneDNN products run on x86-64 Linux only"
    flags = _cpu_flags()
    if not flags & {"amx_bf16", "avx512_bf16"}:
        return "the CPU has neither AMX nor AVX-512 BF16 (bf16 would be emulated, slower than f32)"
    if _library_path() is None:
        return f"{_LIBRARY} not found under {sys.prefix}/lib (pip install onednn-cpu-gomp)"
    try:  # found is not loadable: it needs the system's libgomp, for one
        _runtime()
    except OnednnError as exc:
        return str(exc)
    return None


class _Dnnl:
    """One oneDNN CPU engine and in-order stream for the process."""

    def __init__(self) -> None:
        path = _library_path()
        if path is None:
            raise OnednnError(unavailable_reason() or f"{_LIBRARY} not found")
        # OpenMP threads that spin after a product would take the cores
        # from XLA's threads, which run the rest of the step.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        try:
            self.lib = lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise OnednnError(f"cannot load {path}: {exc}") from None
        lib.dnnl_primitive_desc_query_md.restype = ctypes.c_void_p
        self.engine = ctypes.c_void_p()
        self._check(lib.dnnl_engine_create(ctypes.byref(self.engine), _CPU, ctypes.c_size_t(0)))
        self.stream = ctypes.c_void_p()
        self._check(lib.dnnl_stream_create(ctypes.byref(self.stream), self.engine, _IN_ORDER))
        # XLA may run two callbacks at once (independent products of a
        # step); oneDNN already uses every core for one.
        self.lock = threading.Lock()

    @staticmethod
    def _check(status: int, what: str = "call") -> None:
        if status != 0:
            raise OnednnError(f"oneDNN {what} failed with status {status}")

    def desc(self, dims: tuple[int, ...], dtype: int, tag: int) -> ctypes.c_void_p:
        md = ctypes.c_void_p()
        self._check(
            self.lib.dnnl_memory_desc_create_with_tag(
                ctypes.byref(md), len(dims), _Dims(*dims), dtype, tag
            ),
            "memory descriptor",
        )
        return md

    def memory(self, desc: ctypes.c_void_p, handle: ctypes.c_void_p) -> ctypes.c_void_p:
        mem = ctypes.c_void_p()
        self._check(
            self.lib.dnnl_memory_create(ctypes.byref(mem), desc, self.engine, handle), "memory"
        )
        return mem

    def _matmul_desc(
        self, src: ctypes.c_void_p, weights: ctypes.c_void_p, dst: ctypes.c_void_p
    ) -> ctypes.c_void_p:
        pd = ctypes.c_void_p()
        self._check(
            self.lib.dnnl_matmul_primitive_desc_create(
                ctypes.byref(pd), self.engine, src, weights, None, dst, None
            ),
            "matmul descriptor",
        )
        return pd

    def _primitive(self, pd: ctypes.c_void_p, what: str) -> ctypes.c_void_p:
        """The primitive of a descriptor, which it then destroys."""
        prim = ctypes.c_void_p()
        try:
            self._check(self.lib.dnnl_primitive_create(ctypes.byref(prim), pd), what)
        finally:
            self.lib.dnnl_primitive_desc_destroy(pd)
        return prim

    def matmul(
        self, src: ctypes.c_void_p, weights: ctypes.c_void_p, dst: ctypes.c_void_p
    ) -> ctypes.c_void_p:
        return self._primitive(self._matmul_desc(src, weights, dst), "matmul")

    def preferred_weights(
        self, src: ctypes.c_void_p, weights: ctypes.c_void_p, dst: ctypes.c_void_p
    ) -> ctypes.c_void_p:
        """The weights' layout oneDNN picks for a matmul whose weights are
        given as ``any`` (a descriptor of its own)."""
        pd = self._matmul_desc(src, weights, dst)
        chosen = ctypes.c_void_p()
        try:
            queried = self.lib.dnnl_primitive_desc_query_md(pd, _QUERY_WEIGHTS_MD, 0)
            self._check(
                self.lib.dnnl_memory_desc_clone(ctypes.byref(chosen), ctypes.c_void_p(queried)),
                "descriptor clone",
            )
        finally:
            self.lib.dnnl_primitive_desc_destroy(pd)
        return chosen

    def reorder(self, src: ctypes.c_void_p, dst: ctypes.c_void_p) -> ctypes.c_void_p:
        pd = ctypes.c_void_p()
        self._check(
            self.lib.dnnl_reorder_primitive_desc_create(
                ctypes.byref(pd), src, self.engine, dst, self.engine, None
            ),
            "reorder descriptor",
        )
        return self._primitive(pd, "reorder")

    def destroy(self, handles: list[tuple[str, ctypes.c_void_p]]) -> None:
        """``dnnl_<kind>_destroy`` for each (kind, handle): memory,
        memory_desc or primitive."""
        for kind, handle in handles:
            getattr(self.lib, f"dnnl_{kind}_destroy")(handle)

    def destroy_with(self, owner: object, handles: list[tuple[str, ctypes.c_void_p]]) -> None:
        """Destroy ``handles`` when ``owner`` is collected: a released
        matrix gives back its native copy, not only its Python object."""
        weakref.finalize(owner, self.destroy, handles)

    def execute(self, prim: ctypes.c_void_p, args: list[tuple[int, ctypes.c_void_p]]) -> None:
        packed = (_ExecArg * len(args))(*(_ExecArg(kind, mem) for kind, mem in args))
        self._check(
            self.lib.dnnl_primitive_execute(prim, self.stream, len(args), packed), "execute"
        )
        self._check(self.lib.dnnl_stream_wait(self.stream), "stream wait")


_dnnl: _Dnnl | None = None
_dnnl_lock = threading.Lock()


def _runtime() -> _Dnnl:
    global _dnnl
    with _dnnl_lock:
        if _dnnl is None:
            _dnnl = _Dnnl()
        return _dnnl


class _Operand:
    """A plain row-major array oneDNN reads or writes in place: its
    descriptor and a memory object whose handle is re-pointed per call."""

    def __init__(self, dnnl: _Dnnl, dims: tuple[int, ...], dtype: int) -> None:
        self.desc = dnnl.desc(dims, dtype, _AB)
        self.memory = dnnl.memory(self.desc, ctypes.c_void_p(None))
        self._dnnl = dnnl
        dnnl.destroy_with(self, [("memory", self.memory), ("memory_desc", self.desc)])

    def at(self, array: np.ndarray[Any, Any]) -> ctypes.c_void_p:
        self._dnnl._check(
            self._dnnl.lib.dnnl_memory_set_data_handle(
                self.memory, ctypes.c_void_p(array.ctypes.data)
            ),
            "set handle",
        )
        return self.memory


class PackedMatrix:
    """``x @ W`` for a weight ``W [K, N]``, kept in the blocked bf16 layout
    oneDNN's kernel reads (converted once, here)."""

    def __init__(self, weight: np.ndarray[Any, Any]) -> None:
        import ml_dtypes

        self._dnnl = dnnl = _runtime()
        self.k, self.n = (int(d) for d in weight.shape)
        plain = np.ascontiguousarray(weight, dtype=ml_dtypes.bfloat16)
        # The layout oneDNN prefers for these weights (at a mid-sized row count).
        asked = [
            dnnl.desc((64, self.k), _BF16, _AB),
            dnnl.desc((self.k, self.n), _BF16, _ANY),
            dnnl.desc((64, self.n), _F32, _AB),
        ]
        try:
            self.desc = dnnl.preferred_weights(*asked)
        finally:
            dnnl.destroy([("memory_desc", desc) for desc in asked])
        self.memory = dnnl.memory(self.desc, _ALLOCATE)
        dnnl.destroy_with(self, [("memory", self.memory), ("memory_desc", self.desc)])
        source = _Operand(dnnl, (self.k, self.n), _BF16)
        convert = dnnl.reorder(source.desc, self.desc)
        try:
            dnnl.execute(convert, [(_ARG_SRC, source.at(plain)), (_ARG_DST, self.memory)])
        finally:
            dnnl.destroy([("primitive", convert)])
        self._kernels: dict[int, tuple[ctypes.c_void_p, _Operand, _Operand]] = {}
        self.calls = 0

    def _kernel(self, rows: int) -> tuple[ctypes.c_void_p, _Operand, _Operand]:
        kernel = self._kernels.get(rows)
        if kernel is None:
            dnnl = self._dnnl
            src = _Operand(dnnl, (rows, self.k), _BF16)
            dst = _Operand(dnnl, (rows, self.n), _F32)
            prim = dnnl.matmul(src.desc, self.desc, dst.desc)
            dnnl.destroy_with(self, [("primitive", prim)])
            kernel = self._kernels[rows] = (prim, src, dst)
        return kernel

    def product(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """``x [rows, K]`` (bf16, contiguous) times the weight: ``[rows, N]`` f32."""
        rows = x.shape[0]
        out = np.empty((rows, self.n), np.float32)
        prim, src, dst = self._kernel(rows)
        self._dnnl.execute(
            prim, [(_ARG_SRC, src.at(x)), (_ARG_WEIGHTS, self.memory), (_ARG_DST, dst.at(out))]
        )
        return out


class VocabMatrix:
    """The output projection ``E @ x.T`` for a tied embedding ``E [V, D]``,
    kept plain in bf16: the embedding is the product's left operand, so the
    logits come out vocabulary-major (``[V, rows]``, the sampler's layout)
    with no transpose and the matrix needs no blocked copy."""

    def __init__(self, embed: np.ndarray[Any, Any]) -> None:
        import ml_dtypes

        self._dnnl = _runtime()
        self.vocab, self.d = (int(d) for d in embed.shape)
        self.values = np.ascontiguousarray(embed, dtype=ml_dtypes.bfloat16)
        self._embed = _Operand(self._dnnl, (self.vocab, self.d), _BF16)
        self._embed.at(self.values)
        self._kernels: dict[int, tuple[ctypes.c_void_p, _Operand, _Operand]] = {}
        self.calls = 0

    def product(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """``x [rows, D]`` (bf16): logits ``[V, rows]`` f32."""
        rows = x.shape[0]
        kernel = self._kernels.get(rows)
        dnnl = self._dnnl
        if kernel is None:
            xt = _Operand(dnnl, (self.d, rows), _BF16)
            dst = _Operand(dnnl, (self.vocab, rows), _F32)
            prim = dnnl.matmul(self._embed.desc, xt.desc, dst.desc)
            dnnl.destroy_with(self, [("primitive", prim)])
            kernel = self._kernels[rows] = (prim, xt, dst)
        prim, xt, dst = kernel
        transposed = np.ascontiguousarray(x.T)
        out = np.empty((self.vocab, rows), np.float32)
        dnnl.execute(
            prim,
            [
                (_ARG_SRC, self._embed.memory),
                (_ARG_WEIGHTS, xt.at(transposed)),
                (_ARG_DST, dst.at(out)),
            ],
        )
        return out


class _Registry:
    """The prepared matrices of every engine in the process, by slot."""

    def __init__(self) -> None:
        self._matrices: dict[int, PackedMatrix | VocabMatrix] = {}
        self._next = 0
        self._lock = threading.Lock()

    def add(self, matrix: PackedMatrix | VocabMatrix) -> int:
        with self._lock:
            slot = self._next
            self._next += 1
            self._matrices[slot] = matrix
            return slot

    def get(self, slot: int) -> PackedMatrix | VocabMatrix:
        return self._matrices[slot]

    def release(self, slots: list[int]) -> None:
        with self._lock:
            for slot in slots:
                self._matrices.pop(slot, None)


REGISTRY = _Registry()


class OnednnWeight(NamedTuple):
    """A matrix with its oneDNN form: ``weight`` as XLA multiplies it (an
    array or ``wquant.QuantWeight``, for the small products) and
    ``slot``, the int32 scalar that names its prepared form in ``REGISTRY``."""

    weight: Any
    slot: Any


def columns(weight: OnednnWeight) -> int:
    return matrix_shape(weight.weight)[-1]


def _products(x: Any, *slots: Any) -> tuple[np.ndarray[Any, Any], ...]:
    rows = np.ascontiguousarray(np.asarray(x))
    runtime = _runtime()
    matrices = [REGISTRY.get(int(np.asarray(slot))) for slot in slots]
    with runtime.lock:
        for matrix in matrices:
            matrix.calls += 1
        return tuple(matrix.product(rows) for matrix in matrices)


def dense_many(x: Any, weights: list[OnednnWeight]) -> list[Any]:
    """``x @ w`` for each of ``weights`` (all reading the same ``x [T, K]``)
    in one callback; results in ``x``'s dtype."""
    import jax
    import jax.numpy as jnp

    shapes = [jax.ShapeDtypeStruct((x.shape[0], columns(w)), jnp.float32) for w in weights]
    outs = jax.pure_callback(
        _products, tuple(shapes), x.astype(jnp.bfloat16), *(w.slot for w in weights)
    )
    return [out.astype(x.dtype) for out in outs]


def vocab_major(embed: OnednnWeight, rows: Any) -> Any:
    """Logits ``[V, S]`` f32 for the normed rows ``[S, D]``."""
    import jax
    import jax.numpy as jnp

    vocab = matrix_shape(embed.weight)[0]
    shape = jax.ShapeDtypeStruct((vocab, rows.shape[0]), jnp.float32)
    (out,) = jax.pure_callback(_products, (shape,), rows.astype(jnp.bfloat16), embed.slot)
    return out


# The layers' matrices (model.py's names) and how each is stored: [in, out].
LAYER_MATRICES = ("q", "k", "v", "o", "gate", "up", "down")


def _as_float(weight: Any) -> np.ndarray[Any, Any]:
    if isinstance(weight, QuantWeight):
        return dequantize(QuantWeight(*(None if a is None else np.asarray(a) for a in weight)))
    return np.asarray(weight, np.float32)


def copy_bytes(params: dict[str, Any]) -> int:
    """Bytes of the bf16 copies ``prepare`` makes of ``params``' matrices."""
    layers = params["layers"]
    matrices = [layer[name] for layer in layers for name in LAYER_MATRICES if name in layer]
    return 2 * sum(math.prod(matrix_shape(m)) for m in [*matrices, params["embed"]])


def prepare(params: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """``params`` (per-layer, not stacked) with every layer matrix and the
    tied embedding wrapped as ``OnednnWeight``; and the slots taken (to
    ``REGISTRY.release`` when the engine goes)."""
    import jax.numpy as jnp

    slots: list[int] = []

    def wrap(weight: Any, matrix: PackedMatrix | VocabMatrix) -> OnednnWeight:
        slot = REGISTRY.add(matrix)
        slots.append(slot)
        return OnednnWeight(weight, jnp.asarray(slot, jnp.int32))

    layers = []
    try:
        for layer in params["layers"]:
            layer = dict(layer)
            for name in LAYER_MATRICES:
                if name in layer:
                    layer[name] = wrap(layer[name], PackedMatrix(_as_float(layer[name])))
            layers.append(layer)
        embed = params["embed"]
        embed = wrap(embed, VocabMatrix(_as_float(embed)))
    except OnednnError:
        REGISTRY.release(slots)  # nothing kept of a preparation that failed
        raise
    return {**params, "layers": layers, "embed": embed}, slots
