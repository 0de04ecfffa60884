"""The simulated executor over a small two-kind layout, and the clock and
sampling parameters the scheduler tests share."""

from __future__ import annotations

from kvd.kv.geometry import AttentionKind, KVGeometry, LayerType
from kvd.kv.layout import build_layout
from kvd.sched.executor import ExecutorSizes
from kvd.sched.sampling_params import SamplingParams
from kvd.sched.simulated import SimulatedExecutor

STOP_IDS = frozenset({1})
LIMITS = ExecutorSizes(
    max_model_len=64,
    max_num_seqs=6,
    max_num_batched_tokens=16,
    vocab_size=48,
    token_buckets=(2, 4, 8, 16),
)


def make_executor(pages: int = 90, limits: ExecutorSizes = LIMITS) -> SimulatedExecutor:
    """1 global layer and 4 sliding ones (window 8), block 4: 3 page groups."""
    g, s = AttentionKind.GLOBAL, AttentionKind.SLIDING
    geometry = KVGeometry(
        "tiny", (s, s, g, s, s), (LayerType(g, 1, 16), LayerType(s, 1, 8, 8)), "float32"
    )
    return SimulatedExecutor(build_layout(geometry, 4), pages + 1, limits, STOP_IDS)


class Clock:
    """Time that moves only when a test moves it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)
