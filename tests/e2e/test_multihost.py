"""One kvd over two processes (issue 48): JAX's multi-controller runtime on
this machine, two ``kvd serve`` processes of two virtual CPU devices each
(tensor parallel 4, gloo between them), the real 270M.

The one test here starts the pair once (the suite's budget: a start of two
processes compiling on two cores takes minutes) and checks, in order:
greedy replies through process 0's HTTP API equal the single-process
engine's (computed in this process meanwhile) over a small pool that forces
preemptions by swap, a chunked prefill and a prefix-cache hit; neither
process compiles after warm-up; and SIGKILL of the follower makes the
leader exit non-zero, with one line naming it, within 60 s. The opposite
(the leader killed) and a SIGTERM that drains and stops both are in the
closing note of issue 48 (docs/howto/multi-host.md says what to expect)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from kvd.engine.engine import Engine, EngineConfig
from kvd.engine.loader import EMBEDDED_MODEL, embedded_tokenizer, load_model
from kvd.oneshot.batch import BatchGenerator
from kvd.sched.sampling_params import SamplingParams
from tests.conftest import short_dir
from tests.server.conftest import ALICE, DaemonProcess, digest

MODEL = "gemma3-270m"
NEW_TOKENS = 16  # the suite's budget: two waves of four replies, a few steps each
LONG_TOKENS = 8  # the long prompt's reply: it must fit the small pool alone
MAX_MODEL_LEN, MAX_SEQS, CHUNK = 512, 4, 32
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):\n    ",
    "List three prime numbers:",
    "Once upon a time",
    "東京は日本の",
    "The three laws of thermodynamics are",
    "Translate 'good morning' into Spanish:",
]
# Longer than a prefill chunk (CHUNK tokens): computed in two steps or more.
LONG = "Summarise: " + " ".join(f"item {i} is blue;" for i in range(12))

CONFIG = """
[server]
listen = "127.0.0.1:0"
metrics_listen = "127.0.0.1:0"
admin_socket = "{socket_dir}/admin.sock"
state_file = "state.json"
drain_timeout = 5.0

[model]
source = "{model}"
max_model_len = {max_model_len}
max_num_seqs = {max_seqs}
max_num_batched_tokens = {chunk}
tensor_parallel = 4

[pool]
size = "4MiB"  # four replies at once outgrow it: some are swapped out and back
host_size = "0"

[budget]
preemption = "swap"

[scheduler]
swap_space = "32MiB"

[distributed]
coordinator = "127.0.0.1:{port}"
num_processes = 2

[[tenants]]
name = "alice"
api_key_sha256 = "{alice}"
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def single_process_replies(prompts: list[list[int]], long_prompt: list[int]) -> list[list[int]]:
    """The single-process engine's greedy tokens (one device, this process)."""
    engine = Engine(
        load_model(EMBEDDED_MODEL, "float32", "auto"),
        EngineConfig(
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=MAX_SEQS,
            max_num_batched_tokens=CHUNK,
            pool_tokens=4096,
        ),
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    long = SamplingParams(temperature=0.0, max_tokens=LONG_TOKENS)
    generations = BatchGenerator(engine).generate(
        [*prompts, long_prompt], [greedy] * len(prompts) + [long]
    )
    return [g.completion_ids for g in generations]


class Follower:
    """``kvd serve --process-id 1``: it binds nothing, so only its output tells."""

    def __init__(self, config: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvd.cli", "serve", "--config", str(config)]
            + ["--process-id", "1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(timeout=30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def test_two_processes_serve_as_one(tmp_path: Path, daemon_env: dict[str, str]) -> None:
    socket_dir = short_dir()
    config = tmp_path / "kvd.toml"
    config.write_text(
        CONFIG.format(
            socket_dir=socket_dir,
            model=MODEL,
            max_model_len=MAX_MODEL_LEN,
            max_seqs=MAX_SEQS,
            chunk=CHUNK,
            port=free_port(),
            alice=digest(ALICE),
        )
    )
    env = daemon_env | {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    tokenizer = embedded_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    long_prompt = tokenizer.encode(LONG)
    assert len(long_prompt) > CHUNK
    follower = Follower(config, env)
    leader = None
    try:
        with ThreadPoolExecutor(1) as background:  # the reference, while the pair compiles
            expected = background.submit(single_process_replies, prompts, long_prompt)
            leader = DaemonProcess(config, env, ready_timeout=600, args=("--process-id", "0"))
            reference = expected.result()
        with openai.OpenAI(base_url=f"{leader.url}/v1", api_key=ALICE, max_retries=0) as oai:

            def greedy(prompt: list[int], tokens: int = NEW_TOKENS) -> openai.types.Completion:
                return oai.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=tokens, temperature=0
                )

            with ThreadPoolExecutor(MAX_SEQS) as clients:
                replies = list(clients.map(greedy, prompts))
            first, again = greedy(long_prompt, LONG_TOKENS), greedy(long_prompt, LONG_TOKENS)
            # The prompt's own logprobs: a step whose scoring program the followers run too.
            echoed = oai.completions.create(
                model=MODEL, prompt=prompts[0], max_tokens=1, echo=True, logprobs=1
            )
        assert echoed.choices[0].logprobs is not None
        assert len(echoed.choices[0].logprobs.token_logprobs or []) == len(prompts[0]) + 1
        for prompt, reply, tokens in zip(
            PROMPTS + [LONG], [*replies, first], reference, strict=True
        ):
            assert reply.choices[0].text == tokenizer.decode(tokens), prompt
        assert again.choices[0].text == tokenizer.decode(reference[-1])
        assert again.usage is not None and again.usage.prompt_tokens_details is not None
        assert again.usage.prompt_tokens_details.cached_tokens, "the repeat hit no cached block"
        swaps = [e for e in leader.named("kv.preempt") if e["kind"] == "swap"]
        assert swaps, "no reply was swapped out: the pool was not small enough"
        assert not leader.named("engine.late_compile")
        assert not [line for line in follower.lines if "engine.late_compile" in line]
        following = [line for line in follower.lines if "distributed.following" in line]
        assert following, "".join(follower.lines[-20:])

        follower.proc.kill()
        killed = time.monotonic()
        code = leader.proc.wait(timeout=60)
        assert code != 0
        assert time.monotonic() - killed < 60
        lost = leader.named("distributed.process_lost")
        assert len(lost) == 1 and lost[0]["lost"] == [1], leader.tail()
        assert "process 1" in lost[0]["error"]
    finally:
        follower.stop()
        if leader is not None:
            leader.kill()
