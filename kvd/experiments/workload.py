"""A multi-tenant workload whose shapes come from published production traces.

Each figure below is from a source, cited where it is used:

- LMSYS-Chat-1M (Zheng et al., ICLR 2024, arXiv 2309.11998, Table 1): 2.0
  turns per conversation, 69.5 tokens per user prompt, 214.5 per response.
  CachedAttention (Gao et al., USENIX ATC 2024): 73% of ShareGPT
  conversations are multi-turn. A chat session here is multi-turn with
  probability 0.73, and its turns average 2.0.
- Azure LLM inference trace 2023 (Patel et al., "Splitwise", ISCA 2024;
  github.com/Azure/AzurePublicDataset): conversation requests have a median
  prompt of 1,020 tokens and a median output of 129 (mean 211): one-shot
  outputs are lognormal with that median and sigma 1.0 (mean 213).
- Mooncake (Qin et al., FAST 2025, Table 2): production prompts average
  7,590-12,035 tokens, outputs 182-343, and 40-59% of prompt tokens hit an
  ample cache; Alibaba Bailian ("KVCache Cache in the Wild", Wang et al.,
  USENIX ATC 2025): reuse across single-turn requests (shared system
  prompts, documents) matters as much as multi-turn reuse, about 54-62% of
  tokens with an unbounded cache.
- BurstGPT (Wang et al., KDD 2025, arXiv 2401.17644): Gamma-distributed
  inter-arrival times (bursty, not Poisson); vLLM's benchmarks (Kwon et al.,
  SOSP 2023) use Poisson.

The trace is a list of sessions. A session belongs to a tenant and an end
user, starts at its arrival time, and is one of: a multi-turn chat whose
every turn resends the history (with the replies the model really gave), a
question about a document the tenant's users share (Zipf popularity), or a
unique one-shot prompt. Every prompt starts with the operator's platform
preamble (registered as a public prefix) and the tenant's system prompt; two
tenants build on the same agent framework and so share its system prompt
(which only the `shared` policy lets them share). Segments are named, not
written: a renderer turns a segment into token ids (the KV-core replay) or
text (the daemon), the same name always into the same content.
"""

from __future__ import annotations

import hashlib
import math

import msgspec
import numpy as np

# Sources for the defaults, by field (see the module docstring).
LMSYS_TURNS_MEAN = 2.0
SHAREGPT_MULTI_TURN = 0.73
LMSYS_USER_TOKENS = 69.5
LMSYS_REPLY_TOKENS = 214.5
AZURE_CONV_PROMPT_MEDIAN = 1020
AZURE_CONV_OUTPUT_MEDIAN = 129


class Segment(msgspec.Struct, frozen=True):
    kind: str  # "platform", "system", "document", "user", "oneshot"
    key: str  # same key, same content
    tokens: int


class Turn(msgspec.Struct, frozen=True):
    user: Segment
    max_tokens: int
    think_s: float  # after the previous reply, before this turn is sent


class Session(msgspec.Struct, frozen=True):
    session_id: str
    tenant: str
    user: str  # the end user (the cache salt, when salts are on)
    kind: str  # "chat", "document", "oneshot"
    arrival_s: float
    head: list[Segment]  # platform, system prompt, document
    turns: list[Turn]


class TenantShape(msgspec.Struct, frozen=True):
    name: str
    system_key: str  # tenants with the same key send the same system prompt
    system_tokens: int
    chat: float  # session mix: chat / document / one-shot weights
    document: float
    oneshot: float
    documents: int  # distinct documents its users ask about (Zipf popularity)


class WorkloadShape(msgspec.Struct, frozen=True):
    tenants: list[TenantShape]
    sessions: int
    duration_s: float  # arrivals spread over this long
    platform_tokens: int = 256
    user_tokens: float = LMSYS_USER_TOKENS
    reply_tokens: float = LMSYS_REPLY_TOKENS
    turns_mean: float = LMSYS_TURNS_MEAN  # per chat session
    multi_turn: float = SHAREGPT_MULTI_TURN  # chats with more than one turn
    document_tokens: float = 1500.0  # median; lognormal sigma 0.6
    oneshot_tokens: float = AZURE_CONV_PROMPT_MEDIAN  # median; lognormal sigma 0.8
    oneshot_output: float = AZURE_CONV_OUTPUT_MEDIAN
    think_s: float = 8.0  # mean time a user reads a reply before the next turn
    users_per_tenant: int = 6
    zipf: float = 1.1  # document popularity exponent
    burstiness: float = 0.5  # Gamma shape of inter-arrival times (1 = Poisson)
    scale: float = 1.0  # every token length multiplied by this
    max_reply: int = 512  # a cap on every reply (trims LMSYS's 214.5 mean to about 194)
    seed: int = 0


def default_shape(
    sessions: int = 120, duration_s: float = 300.0, scale: float = 1.0
) -> WorkloadShape:
    return WorkloadShape(
        tenants=[
            TenantShape(
                "support", "support", 900, chat=0.7, document=0.2, oneshot=0.1, documents=8
            ),
            TenantShape("docs", "docs", 400, chat=0.2, document=0.7, oneshot=0.1, documents=12),
            TenantShape(
                "agent", "agentkit", 1200, chat=0.5, document=0.1, oneshot=0.4, documents=4
            ),
            TenantShape(
                "coder", "agentkit", 1200, chat=0.4, document=0.0, oneshot=0.6, documents=1
            ),
        ],
        sessions=sessions,
        duration_s=duration_s,
        scale=scale,
    )


def generate(shape: WorkloadShape) -> list[Session]:
    rng = np.random.default_rng(shape.seed)
    scaled = _Scaler(shape.scale)
    weights = np.array([1.0] * len(shape.tenants))
    gaps = rng.gamma(shape.burstiness, 1.0 / shape.burstiness, shape.sessions)
    arrivals = np.cumsum(gaps)
    arrivals *= shape.duration_s / arrivals[-1] if shape.sessions > 1 else 0.0
    platform = Segment("platform", "platform", scaled(shape.platform_tokens))
    sessions = []
    for i in range(shape.sessions):
        tenant = shape.tenants[int(rng.choice(len(shape.tenants), p=weights / weights.sum()))]
        kinds = np.array([tenant.chat, tenant.document, tenant.oneshot])
        kind = ("chat", "document", "oneshot")[int(rng.choice(3, p=kinds / kinds.sum()))]
        user = f"{tenant.name}-user{int(rng.integers(shape.users_per_tenant))}"
        head = [platform, Segment("system", tenant.system_key, scaled(tenant.system_tokens))]
        sid = f"s{i:04d}"
        if kind == "document":
            doc = _zipf_pick(rng, tenant.documents, shape.zipf)
            head.append(
                Segment(
                    "document",
                    f"{tenant.name}-doc{doc}",
                    scaled(_lognormal(shape.document_tokens, 0.6, f"{tenant.name}{doc}")),
                )
            )
        if kind == "oneshot":
            prompt = scaled(rng.lognormal(math.log(shape.oneshot_tokens), 0.8))
            output = rng.lognormal(math.log(shape.oneshot_output), 1.0)
            turns = [
                Turn(
                    Segment("oneshot", f"{sid}-q", prompt),
                    min(shape.max_reply, scaled(output)),
                    0.0,
                )
            ]
        else:
            count = _chat_turns(rng, shape) if kind == "chat" else 1
            turns = [
                Turn(
                    Segment("user", f"{sid}-t{t}", scaled(rng.exponential(shape.user_tokens))),
                    _reply(rng, shape.reply_tokens, shape, scaled),
                    0.0 if t == 0 else float(rng.exponential(shape.think_s)),
                )
                for t in range(count)
            ]
        sessions.append(Session(sid, tenant.name, user, kind, float(arrivals[i]), head, turns))
    return sessions


class _Scaler:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, tokens: float) -> int:
        return max(4, round(tokens * self.scale))


def _reply(rng: np.random.Generator, mean: float, shape: WorkloadShape, scaled: _Scaler) -> int:
    return min(shape.max_reply, scaled(rng.exponential(mean)))


def _chat_turns(rng: np.random.Generator, shape: WorkloadShape) -> int:
    """One turn, or (with probability ``multi_turn``) 1 + a geometric number
    of turns, so that chats average ``turns_mean``."""
    if rng.random() >= shape.multi_turn:
        return 1
    extra_mean = (shape.turns_mean - 1) / shape.multi_turn
    return 1 + int(rng.geometric(1.0 / extra_mean))


def _zipf_pick(rng: np.random.Generator, n: int, exponent: float) -> int:
    weights = 1.0 / np.arange(1, n + 1) ** exponent
    return int(rng.choice(n, p=weights / weights.sum()))


def _lognormal(median: float, sigma: float, seed_key: str) -> float:
    """A document's length is a property of the document, not of the request."""
    local = np.random.default_rng(
        int.from_bytes(hashlib.blake2b(seed_key.encode(), digest_size=8).digest())
    )
    return float(local.lognormal(math.log(median), sigma))


def platform_segment(sessions: list[Session]) -> Segment:
    """The operator's platform preamble every prompt starts with."""
    return next(seg for s in sessions for seg in s.head if seg.kind == "platform")


def segment_tokens(segment: Segment, vocab: tuple[int, int]) -> list[int]:
    """The same segment key always becomes the same token ids."""
    seed = int.from_bytes(hashlib.blake2b(segment.key.encode(), digest_size=8).digest())
    low, high = vocab
    return np.random.default_rng(seed).integers(low, high, segment.tokens).tolist()


_WORD_TEXT = """
the of and to in is was for on that with as by at from it an be this are or which
system user report value table order account service request data model answer time
page record policy number result support document section summary customer product
update item list change note status review check plan team project code function test
error file build query field price date region total level share group event
"""
_WORDS = tuple(_WORD_TEXT.split())


def segment_text(segment: Segment) -> str:
    """Plain words, about one token each for a SentencePiece vocabulary."""
    seed = int.from_bytes(hashlib.blake2b(segment.key.encode(), digest_size=8).digest())
    picks = np.random.default_rng(seed).integers(0, len(_WORDS), segment.tokens)
    return " ".join(_WORDS[i] for i in picks) + "\n"


def total_requests(sessions: list[Session]) -> int:
    return sum(len(s.turns) for s in sessions)
