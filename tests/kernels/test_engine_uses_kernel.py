"""The engine wired to the kernel: the same tokens as with the reference."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import msgspec  # noqa: E402
import pytest  # noqa: E402

from kvd.engine.engine import Engine, EngineConfig, EngineError  # noqa: E402
from kvd.engine.loader import random_model  # noqa: E402
from kvd.oneshot.batch import BatchGenerator  # noqa: E402
from kvd.sched.sampling_params import SamplingParams  # noqa: E402

CONFIG = EngineConfig(
    block_size=8, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, pool_tokens=256
)


def run(attention: str) -> list[list[int]]:
    config = msgspec.structs.replace(CONFIG, attention=attention)
    engine = Engine(random_model(vocab_size=64, sliding_window=12, seed=3), config)
    prompts = [[2, *range(5, 25)], [2, 7, 9, 11]]  # the first crosses the 12-token window
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    generations = BatchGenerator(engine).generate(prompts, [greedy, greedy])
    return [g.completion_ids for g in generations]


def test_kernel_and_reference_generate_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvd_kernels.ragged_paged_attention as module

    traced: list[int] = []
    kernel = module.ragged_paged_attention

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        traced.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(module, "ragged_paged_attention", spy)
    with_kernel = run("pallas-interpret")
    assert traced  # the engine traced the kernel, not the reference
    count = len(traced)
    assert with_kernel == run("reference")
    assert len(traced) == count


def test_a_bad_choice_is_named() -> None:
    with pytest.raises(EngineError, match="attention 'cuda': use auto, reference"):
        run("cuda")
