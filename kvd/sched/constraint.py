"""What the scheduler needs of a structured-output constraint (a grammar the
output must follow), whatever engine compiles it: the protocol, and the
bitmask layout the executors read.

A constraint follows one sequence's output. Before each step in which the
sequence samples a token, it writes the tokens it allows into a bitmask row;
the executor masks every other token out of that row's logits, on the
device. After the step it is told the token sampled. Nothing here imports
JAX or a grammar engine (kvd/server/grammar.py builds constraints with
llguidance).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

Array = np.ndarray[Any, Any]

BITS = 32  # tokens per mask word


def mask_words(vocab_size: int) -> int:
    """Words of one row of a token bitmask (bit ``t % 32`` of word ``t // 32``:
    token ``t`` may be sampled)."""
    return (vocab_size + BITS - 1) // BITS


def allowed_tokens(row: Array, vocab_size: int) -> Array:
    """The token ids a bitmask row allows, ascending."""
    bits = np.unpackbits(np.ascontiguousarray(row, np.int32).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


class Constraint(Protocol):
    def fill_mask(self, row: Array) -> None:
        """Write the tokens allowed next into ``row`` (int32, ``mask_words`` long)."""

    def accept(self, token: int) -> bool:
        """Follow the sampled ``token``; False if the grammar does not allow it."""

    def finished(self) -> bool:
        """Whether the output is complete: no token may follow."""

    def fork(self) -> Constraint:
        """An independent copy in the same state (another choice of a request)."""

    def error(self) -> str:
        """Why the constraint failed (after ``accept`` returned False)."""
