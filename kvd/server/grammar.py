"""Structured output: a request's format (a JSON schema, JSON at all, a
regular expression, a list of choices, a Lark grammar) compiled with
llguidance into a constraint the scheduler follows token by token
(kvd/sched/constraint.py), and the token masks applied in the device step.

Why llguidance: it has no dependency (a Rust extension; xgrammar needs torch,
transformers and triton at run time), it computes a mask on demand from the
grammar's lexer and parser rather than precomputing an index over the whole
262,144-token vocabulary (measured on the 270M's tokenizer: a JSON schema
compiles in about 1 ms, a mask takes about 20 us), and a compiled matcher
forks in microseconds (``deep_copy``), so a grammar is compiled once per
distinct format and each request (each choice) takes a copy.

JSON is generated compact but readable: ``", "`` between items and ``": "``
after keys, and no other whitespace. llguidance's default lets whitespace run
anywhere, which a small model fills without end.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from typing import Any

import msgspec

from kvd.engine.tokenizer import Tokenizer
from kvd.sched.constraint import Array

CACHE_SIZE = 256  # compiled formats kept, least recently used dropped
_JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Gemma's tokens llguidance must treat as special (never text): its control,
# unknown and unused pieces, marked as llguidance expects with a leading 0xFF.
_SPECIAL = b"\xff"


class GrammarError(ValueError):
    """A format that cannot be compiled; ``param`` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class Grammar(msgspec.Struct, frozen=True):
    """A request's output format, as the API found it."""

    kind: str  # "json" (source: a JSON schema), "regex", "choice" (JSON list), "lark"
    source: str
    param: str  # the request field it came from, for errors


class GuidedOutput:
    """One sequence's grammar state (kvd/sched/constraint.py's protocol)."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_mask(self, row: Array) -> None:
        assert row.flags["C_CONTIGUOUS"] and row.dtype.itemsize == 4
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token: int) -> bool:
        return bool(self._matcher.consume_token(token))

    def finished(self) -> bool:
        return bool(self._matcher.is_stopped())

    def fork(self) -> GuidedOutput:
        return GuidedOutput(self._matcher.deep_copy())

    def error(self) -> str:
        return str(self._matcher.get_error())


class GrammarCompiler:
    """Formats compiled for one tokenizer, the most recent ``CACHE_SIZE``
    cached. Thread-safe: the API compiles in worker threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._lltokenizer: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.compiles = 0
        self.hits = 0

    def constraint(self, grammar: Grammar) -> GuidedOutput:
        """A fresh constraint for ``grammar``, compiled on first use; raises
        GrammarError when it cannot be compiled."""
        key = (grammar.kind, grammar.source)
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return GuidedOutput(pristine.deep_copy())
            lltokenizer = self._tokenizer()
        from llguidance import LLMatcher

        source = _grammar_source(grammar)
        matcher = LLMatcher(lltokenizer, source, log_level=0)
        if matcher.is_error():
            raise GrammarError(
                f"{grammar.param}: cannot be compiled: {_brief(matcher.get_error())}",
                grammar.param,
            )
        with self._lock:
            self.compiles += 1
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return GuidedOutput(matcher.deep_copy())

    def _tokenizer(self) -> Any:
        """llguidance's view of the vocabulary, built on first use (about 2 s
        for Gemma's 262,144 tokens); call with the lock held."""
        if self._lltokenizer is None:
            from llguidance import LLTokenizer, TokenizerWrapper

            wrapper = TokenizerWrapper(_Vocabulary(self.tokenizer, self.vocab_size))
            self._lltokenizer = LLTokenizer(
                wrapper, n_vocab=self.vocab_size, eos_token=sorted(self.tokenizer.stop_ids())
            )
        return self._lltokenizer


_COMPILERS: weakref.WeakKeyDictionary[Tokenizer, GrammarCompiler] = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Tokenizer, vocab_size: int) -> GrammarCompiler:
    """The process's compiler for ``tokenizer`` (one vocabulary build each)."""
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(tokenizer)
        if compiler is None or compiler.vocab_size != vocab_size:
            compiler = _COMPILERS[tokenizer] = GrammarCompiler(tokenizer, vocab_size)
        return compiler


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: each token's bytes, the end
    token, and an encoder."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = tokenizer.token_bytes(special_prefix=_SPECIAL)
        self.tokens += [b""] * (vocab_size - len(self.tokens))
        self.special_token_ids = [i for i, t in enumerate(self.tokens) if t[:1] == _SPECIAL]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_bos=False)


def _grammar_source(grammar: Grammar) -> str:
    from llguidance import LLMatcher

    if grammar.kind == "json":
        try:
            return str(LLMatcher.grammar_from_json_schema(grammar.source, defaults=_JSON_OPTIONS))
        except ValueError as exc:
            raise GrammarError(
                f"{grammar.param}: not a JSON schema: {_brief(str(exc))}", grammar.param
            ) from None
    if grammar.kind == "regex":
        return str(LLMatcher.grammar_from_regex(grammar.source))
    if grammar.kind == "choice":
        options = json.loads(grammar.source)
        # Lark string literals take JSON's escapes: each choice matched verbatim.
        rule = " | ".join(json.dumps(option) for option in options)
        return str(LLMatcher.grammar_from_lark(f"start: {rule}"))
    if grammar.kind == "lark":
        return str(LLMatcher.grammar_from_lark(grammar.source))
    raise GrammarError(f"unknown format kind {grammar.kind!r}", grammar.param)


def _brief(message: str) -> str:
    """An llguidance error on one line (it spans several: where, then why)."""
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return (text[:300] + "...") if len(text) > 300 else text or "invalid"
