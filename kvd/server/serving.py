"""What the tenants' handlers serve from: the runtime once loaded, the
tokenizer, the keys, the limits and the daemon's status. Plain data shared by
the HTTP app, the admin API and the daemon; no web framework, no JAX."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvd.engine.tokenizer import Tokenizer
from kvd.server.config import DEFAULT_MAX_N
from kvd.server.metrics import Metrics
from kvd.server.runtime import Runtime
from kvd.server.status import ServerStatus


@dataclass
class TenantAccess:
    name: str
    tier: str  # the most important tier it may use


@dataclass
class ServerContext:
    runtime: Runtime | None  # None until the model is loaded
    tokenizer: Tokenizer | None
    model_name: str
    vocab_size: int
    max_model_len: int
    tiers: tuple[str, ...]
    metrics: Metrics
    keys: dict[str, TenantAccess]  # SHA-256 hex of the bearer key -> tenant
    status: ServerStatus = field(default_factory=ServerStatus)
    log_prompts: bool = False
    queue_timeout: float | None = None
    max_n: int = DEFAULT_MAX_N
    weight_bytes: int = 0  # the loaded model's parameters, as held on the device
    quantization: str = "none"  # the weights' format as loaded ("auto" resolved)
    # Processes and the weight and pool bytes each host's devices hold (Engine.bytes_here).
    hosts: dict[str, int] = field(default_factory=dict)
    created: int = field(default_factory=lambda: int(time.time()))
