"""What the scheduler needs of a request's stop strings, whatever decodes
its tokens to text: the protocol.

The scheduler decides every end of a generation (``tokens.py``): the
model's end tokens, a request's stop ids and length as arrays over the
batch, and, through this protocol, its stop strings, one token at a time
as it records them. Text is the API's business (kvd/server/stopstrings.py
builds these with the model's tokenizer), so nothing here decodes.
"""

from __future__ import annotations

from typing import Protocol


class StopCondition(Protocol):
    def accept(self, token: int) -> bool:
        """Follow the next output ``token``; True if the output now holds a
        stop string (the generation ends with this token)."""

    def fork(self) -> StopCondition:
        """A fresh copy for another choice of the same request (nothing seen)."""
