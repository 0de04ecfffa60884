"""One engine over the hosts of a slice: the leader's device calls, replayed
by every other process in the same order, through JAX's own collectives.

Under JAX's multi-controller runtime (``jax.distributed.initialize``) a
program over the global mesh runs only when every process dispatches it,
with the same host inputs. Process 0 (the leader) owns the scheduler and
decides each step; the others (followers) own nothing but their devices'
shards. Before each device call the leader sends one *message*: a fixed
header (what to run, its static shape, how its host arrays are laid out),
then, when there are any, the host arrays packed into one int32 buffer. Both
travel by an all-reduce over a ``[processes, n]`` array to which only the
leader contributes (``jax.experimental.multihost_utils.broadcast_one_to_all``
does the same, but compiles on first use): the followers read the sum, the
leader never waits for it, so a step's dispatch costs the leader no round
trip. Payloads are padded to a fixed set of sizes compiled at warm-up, so
nothing compiles while serving.

Float and int8 arrays travel as their bits (viewed as int32, summed with
zeros: exact). Nothing here knows what a step is: ``kvd.engine.engine``
builds the messages and replays them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# What a message asks every process to run.
STEP, GATHER, SCATTER, STOP = 1, 2, 3, 4
OP_NAMES = {STEP: "step", GATHER: "gather", SCATTER: "scatter", STOP: "stop"}

HEADER = 128  # int32 words: op, statics, payload size, array descriptors
MAX_STATICS = 8
MAX_ARRAYS = 12
MAX_DIMS = 4
_DESCRIPTOR = 2 + MAX_DIMS  # dtype code, ndim, dims
# The header's layout: [op, statics count, statics..., payload words, arrays count,
# descriptors...]; a descriptor's dtype code -1 marks an absent (None) array.
_DTYPES = (
    np.dtype(np.int32),
    np.dtype(np.float32),
    np.dtype(np.int8),
    np.dtype(np.bool_),
    np.dtype(ml_dtypes.bfloat16),  # a bf16 pool's pages
    np.dtype(np.float16),
    np.dtype(np.uint8),
)
MIN_PAYLOAD = 1 << 12  # int32 words in the smallest payload bucket
# How long a process waits at a barrier for the others (one may still be
# compiling: minutes on a large model).
BARRIER_TIMEOUT_MS = 60 * 60 * 1000
ABSENT = -1


class LockstepError(RuntimeError):
    """A message the followers cannot carry (too many arrays, an unknown dtype)."""


class Message(NamedTuple):
    op: int
    statics: tuple[int, ...]
    arrays: tuple[Any, ...]  # numpy arrays, None where the leader had none


def payload_buckets(largest_words: int) -> tuple[int, ...]:
    """Payload sizes (int32 words) from ``MIN_PAYLOAD`` up by 4x to one that
    holds ``largest_words``: padding costs little next to a compile."""
    sizes = [MIN_PAYLOAD]
    while sizes[-1] < largest_words:
        sizes.append(sizes[-1] * 4)
    return tuple(sizes)


class Lockstep:
    """The leader's sender or a follower's receiver (``jax.process_index()``
    decides). ``largest_words``: the largest payload a message will carry."""

    def __init__(self, largest_words: int) -> None:
        self.process = jax.process_index()
        self.processes = jax.process_count()
        self.leader = self.process == 0
        # One row of devices per process (ids need not be grouped by process).
        ordered = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        devices = np.array(ordered).reshape(self.processes, jax.local_device_count())
        mesh = Mesh(devices, ("processes", "local"))
        self._rows = NamedSharding(mesh, P("processes"))
        self._everywhere = NamedSharding(mesh, P())
        self._sum = jax.jit(lambda rows: rows.sum(axis=0), out_shardings=self._everywhere)
        self.buckets = payload_buckets(max(HEADER, largest_words))
        self._programs: dict[int, Any] = {}
        self.messages = 0

    def meet(self, name: str) -> None:
        """Wait until every process gets here, through JAX's coordination
        service (no collective). Before a process's first collectives: a
        collective's first use sets up its communicators and gives the peers
        only 30 s to join, so a process still compiling would fail it."""
        from jax._src import distributed as jax_distributed

        client = jax_distributed.global_state.client
        assert client is not None
        client.wait_at_barrier(f"kvd/{name}", BARRIER_TIMEOUT_MS)

    def compile(self) -> None:
        """Compile the header's and every payload bucket's program (warm-up)."""
        for size in (HEADER, *self.buckets):
            self._program(size)

    def _program(self, size: int) -> Any:
        program = self._programs.get(size)
        if program is None:
            spec = jax.ShapeDtypeStruct((self.processes, size), np.int32, sharding=self._rows)
            program = self._sum.lower(spec).compile()
            self._programs[size] = program
        return program

    def _carry(self, words: np.ndarray[Any, Any]) -> Any:
        """All-reduce ``words`` (the leader's; zeros elsewhere) to every process."""
        mine = words if self.leader else np.zeros_like(words)
        rows = jax.make_array_from_process_local_data(
            self._rows, mine[None, :], (self.processes, words.shape[0])
        )
        return self._program(words.shape[0])(rows)

    # -- the leader ----------------------------------------------------------------

    def send(self, op: int, statics: tuple[int, ...], arrays: tuple[Any, ...] = ()) -> Any:
        """Send one message (the leader only). Returns without waiting for it:
        what is returned is ready once every follower has it."""
        header, payload = encode(op, statics, arrays, self.buckets)
        carried = self._carry(header)
        if payload is not None:
            carried = self._carry(payload)
        self.messages += 1
        return carried

    # -- a follower ------------------------------------------------------------------

    def receive(self) -> Message:
        """Wait for the leader's next message (a follower only)."""
        header = np.asarray(self._carry(np.zeros(HEADER, np.int32)))
        words = int(header[2 + MAX_STATICS])
        payload = None
        if words:
            payload = np.asarray(self._carry(np.zeros(words, np.int32)))
        self.messages += 1
        return decode(header, payload)


def encode(
    op: int, statics: tuple[int, ...], arrays: tuple[Any, ...], buckets: tuple[int, ...]
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any] | None]:
    """(header, payload or None) for a message."""
    if len(statics) > MAX_STATICS or len(arrays) > MAX_ARRAYS:
        raise LockstepError(f"a message holds at most {MAX_STATICS} statics, {MAX_ARRAYS} arrays")
    header = np.zeros(HEADER, np.int32)
    header[0], header[1] = op, len(statics)
    header[2 : 2 + len(statics)] = statics
    at = 3 + MAX_STATICS
    header[at] = len(arrays)
    parts: list[np.ndarray[Any, Any]] = []
    for i, array in enumerate(arrays):
        descriptor = header[at + 1 + i * _DESCRIPTOR : at + 1 + (i + 1) * _DESCRIPTOR]
        if array is None:
            descriptor[0] = ABSENT
            continue
        array = np.asarray(array, order="C")  # (ascontiguousarray makes a scalar 1-d)
        if array.dtype not in _DTYPES or array.ndim > MAX_DIMS:
            raise LockstepError(f"cannot carry a {array.dtype} array of {array.ndim} dimensions")
        descriptor[0], descriptor[1] = _DTYPES.index(array.dtype), array.ndim
        descriptor[2 : 2 + array.ndim] = array.shape
        raw = array.reshape(-1).view(np.uint8)
        parts.append(np.pad(raw, (0, -raw.size % 4)).view(np.int32))
    if not parts:
        return header, None
    words = sum(part.size for part in parts)
    size = next((b for b in buckets if b >= words), None)
    if size is None:
        raise LockstepError(f"a payload of {words} words exceeds the largest bucket {buckets[-1]}")
    payload = np.zeros(size, np.int32)
    payload[:words] = np.concatenate(parts)
    header[2 + MAX_STATICS] = size
    return header, payload


def decode(header: np.ndarray[Any, Any], payload: np.ndarray[Any, Any] | None) -> Message:
    op, count = int(header[0]), int(header[1])
    statics = tuple(int(v) for v in header[2 : 2 + count])
    at = 3 + MAX_STATICS
    arrays: list[np.ndarray[Any, Any] | None] = []
    raw = None if payload is None else payload.view(np.uint8)
    offset = 0
    for i in range(int(header[at])):
        descriptor = header[at + 1 + i * _DESCRIPTOR : at + 1 + (i + 1) * _DESCRIPTOR]
        if descriptor[0] == ABSENT:
            arrays.append(None)
            continue
        dtype = _DTYPES[int(descriptor[0])]
        shape = tuple(int(d) for d in descriptor[2 : 2 + int(descriptor[1])])
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        assert raw is not None
        arrays.append(raw[offset : offset + nbytes].view(dtype).reshape(shape).copy())
        offset += nbytes + (-nbytes % 4)
    return Message(op, statics, tuple(arrays))
