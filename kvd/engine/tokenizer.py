"""Gemma's tokenizer, rebuilt from a GGUF file's metadata (or a checkpoint's
tokenizer.model), with streaming detokenisation and the chat turn format.

A GGUF file carries the SentencePiece vocabulary (pieces, scores, types) but
not the model file itself; the pieces and scores are exactly SentencePiece
BPE's, so kvd writes them back into a SentencePiece ModelProto (with Gemma's
normaliser settings: no dummy prefix, whitespace kept, digits split, byte
fallback) and lets the sentencepiece library encode. Two repairs are needed:
whitespace-only pieces are stored with real spaces and are respelled with
``▁``; and control tokens (``<start_of_turn>``...) written in the text are cut
out and mapped to their ids, as the transformers tokenizer does, because
SentencePiece itself never matches control pieces in text.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

# GGUF token types (llama.cpp's enum)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_SPACE = "\u2581"


class TokenizerError(ValueError):
    pass


class ChatMessage(msgspec.Struct, frozen=True):
    role: str  # "system", "user", "assistant" (or "model")
    content: str


class Tokenizer:
    """Encode and decode Gemma text. Thread-safe for concurrent use (read-only)."""

    def __init__(self, model_proto: bytes) -> None:
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self.model_proto = model_proto
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id = self._sp.bos_id()
        self.eos_id = self._sp.eos_id()
        self.pad_id = self._sp.pad_id()
        self._control = {
            self._sp.id_to_piece(i): i for i in range(self.vocab_size) if self._sp.is_control(i)
        }
        # A set lookup per streamed token, not a call into SentencePiece.
        self._control_ids = frozenset(self._control.values())
        names = sorted(self._control, key=len, reverse=True)
        self._control_re = re.compile("|".join(re.escape(n) for n in names)) if names else None
        self.start_of_turn = self._control.get("<start_of_turn>")
        self.end_of_turn = self._control.get("<end_of_turn>")

    # -- building --------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> Tokenizer:
        from sentencepiece import sentencepiece_model_pb2 as pb

        try:
            tokens = metadata["tokenizer.ggml.tokens"]
            scores = metadata["tokenizer.ggml.scores"]
            types = metadata["tokenizer.ggml.token_type"]
        except KeyError as exc:
            raise TokenizerError(f"GGUF metadata lacks {exc.args[0]}") from None
        if metadata.get("tokenizer.ggml.model") != "llama":
            raise TokenizerError(
                f"GGUF tokenizer model {metadata.get('tokenizer.ggml.model')!r} is not "
                "SentencePiece ('llama'); kvd reads Gemma's SentencePiece vocabularies"
            )
        piece_type = pb.ModelProto.SentencePiece  # type: ignore[attr-defined]
        kinds = {
            _NORMAL: piece_type.NORMAL,
            _UNKNOWN: piece_type.UNKNOWN,
            _CONTROL: piece_type.CONTROL,
            _USER_DEFINED: piece_type.USER_DEFINED,
            _UNUSED: piece_type.UNUSED,
            _BYTE: piece_type.BYTE,
        }
        unk = int(metadata.get("tokenizer.ggml.unknown_token_id", 3))
        proto = pb.ModelProto()  # type: ignore[attr-defined]
        for index, (token, score, kind) in enumerate(
            zip(tokens, scores.tolist(), types.tolist(), strict=True)
        ):
            piece = proto.pieces.add()
            piece.piece = _SPACE * len(token) if token and not token.strip(" ") else token
            piece.score = score
            piece.type = piece_type.UNKNOWN if index == unk else kinds.get(kind, piece_type.NORMAL)
        trainer = proto.trainer_spec
        trainer.model_type = pb.TrainerSpec.BPE  # type: ignore[attr-defined]
        trainer.vocab_size = len(tokens)
        trainer.byte_fallback = True
        trainer.split_digits = True
        trainer.allow_whitespace_only_pieces = True
        trainer.split_by_whitespace = False
        # SentencePiece finds its special tokens by piece, not by id.
        for role, key, default in (
            ("unk", "unknown_token_id", unk),
            ("bos", "bos_token_id", 2),
            ("eos", "eos_token_id", 1),
            ("pad", "padding_token_id", 0),
        ):
            token_id = int(metadata.get(f"tokenizer.ggml.{key}", default))
            setattr(trainer, f"{role}_id", token_id)
            setattr(trainer, f"{role}_piece", tokens[token_id])
        normalizer = proto.normalizer_spec
        normalizer.name = "identity"
        normalizer.add_dummy_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", False))
        normalizer.remove_extra_whitespaces = False
        normalizer.escape_whitespaces = True
        return cls(proto.SerializeToString())

    @classmethod
    def load(cls, path: Path) -> Tokenizer:
        try:
            return cls(path.read_bytes())
        except (OSError, RuntimeError) as exc:
            raise TokenizerError(f"{path}: not a SentencePiece model ({exc})") from None

    def save(self, path: Path) -> None:
        """Write the model atomically (a crash never leaves half a file)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as handle:
            handle.write(self.model_proto)
        os.replace(tmp, path)

    # -- encoding and decoding ---------------------------------------------------

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        if self._control_re is None:
            return ids + self._sp.encode(text)
        at = 0
        for match in self._control_re.finditer(text):
            if match.start() > at:
                ids += self._sp.encode(text[at : match.start()])
            ids.append(self._control[match.group()])
            at = match.end()
        if at < len(text):
            ids += self._sp.encode(text[at:])
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of ``ids``; control tokens are dropped, or spelled out if not skipped."""
        if skip_special:
            controls = self._control_ids
            return self._sp.decode([i for i in ids if i not in controls])
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if self._sp.is_control(i):
                parts.append(self._sp.decode(run))
                parts.append(self._sp.id_to_piece(i))
                run = []
            else:
                run.append(i)
        parts.append(self._sp.decode(run))
        return "".join(parts)

    def token_bytes(self, special_prefix: bytes = b"") -> list[bytes]:
        """Each token's text as bytes (byte-fallback tokens their one byte);
        control, unknown and unused tokens are ``special_prefix`` + their name."""
        sp = self._sp
        out = []
        for token in range(self.vocab_size):
            piece = sp.id_to_piece(token)
            if sp.is_byte(token):
                out.append(bytes([int(piece[3:5], 16)]))  # "<0xAB>"
            elif sp.is_control(token) or sp.is_unknown(token) or sp.is_unused(token):
                out.append(special_prefix + piece.encode())
            else:
                out.append(piece.replace(_SPACE, " ").encode())
        return out

    def is_control(self, token: int) -> bool:
        return bool(self._sp.is_control(token))

    def stop_ids(self) -> frozenset[int]:
        """Tokens that end a generation: EOS, and the end of a chat turn."""
        ids = {self.eos_id}
        if self.end_of_turn is not None:
            ids.add(self.end_of_turn)
        return frozenset(ids)

    # -- chat --------------------------------------------------------------------

    def chat_prompt(self, messages: Iterable[ChatMessage]) -> list[int]:
        """Gemma's turn format, ending with an open model turn.

        Gemma has no system role: a system message is prepended to the first
        user turn, separated by a blank line, as Gemma's own template does.
        """
        turns: list[tuple[str, str]] = []
        system: list[str] = []
        for message in messages:
            role = message.role
            if role == "system":
                system.append(message.content)
                continue
            if role not in ("user", "assistant", "model"):
                raise TokenizerError(f"unknown chat role {role!r} (system, user, assistant)")
            content = message.content
            if system and role == "user":
                content = "\n\n".join([*system, content])
                system = []
            turns.append(("model" if role == "assistant" else role, content))
        if system:
            turns.append(("user", "\n\n".join(system)))
        if not turns or turns[-1][0] != "user":
            raise TokenizerError("a chat must end with a user message")
        text = "".join(f"<start_of_turn>{r}\n{c}<end_of_turn>\n" for r, c in turns)
        return self.encode(text + "<start_of_turn>model\n")

    def chat_system_prefix(self, system: str) -> list[int]:
        """The tokens every chat prompt with this system message starts with,
        as ``chat_prompt`` renders it: the first user turn opens with the
        system text and a blank line. (Its last tokens may merge with the
        user's text; prefix matching counts only the blocks that agree.)"""
        return self.encode(f"<start_of_turn>user\n{system}\n\n")


class StreamDecoder:
    """Incremental detokenisation that never emits broken UTF-8.

    Text is emitted from a checkpoint: all tokens before it decoded to
    complete characters, so decoding is additive there. New text is held back
    while it ends in an incomplete UTF-8 sequence (the replacement character
    U+FFFD from byte-fallback tokens), and the concatenation of everything
    emitted equals ``decode(all tokens)``.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._start = 0  # tokens before this are final
        self._emitted = ""  # text emitted since the checkpoint

    def push(self, tokens: Iterable[int]) -> str:
        """Add tokens; return the new text that is safe to emit (maybe empty)."""
        self._ids.extend(tokens)
        text = self._tokenizer.decode(self._ids[self._start :])
        if text.endswith("\ufffd"):
            # Hold the incomplete character back; what precedes it is final.
            safe = text.rstrip("\ufffd")
            delta = safe[len(self._emitted) :]
            self._emitted = safe
            return delta
        delta = text[len(self._emitted) :]
        self._start = len(self._ids)
        self._emitted = ""
        return delta

    def flush(self) -> str:
        """Whatever is held back (an incomplete character at the very end)."""
        text = self._tokenizer.decode(self._ids[self._start :])
        delta = text[len(self._emitted) :]
        self._start, self._emitted = len(self._ids), ""
        return delta
