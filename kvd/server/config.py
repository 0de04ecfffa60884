"""The daemon's TOML configuration, decoded into msgspec Structs.

Every section rejects unknown keys, so a typo is an error naming the key, not
a silently ignored setting. Relative paths are taken from the configuration
file's own directory, so a config works wherever the daemon is started from.

Sizes of the pool and of tenant budgets take byte units (``"1GiB"``) or, for
budgets, a share of the pool (``"25%"``); they become pages once the model's
page size is known (``resolve_budgets``).
"""

from __future__ import annotations

import hashlib
import math
import re
import tomllib
from decimal import Decimal, InvalidOperation
from pathlib import Path

import msgspec

from kvd.engine.config import ATTENTION_CHOICES, MATMUL_CHOICES, EngineDefaults
from kvd.kv.events import EventEncoding, PrivateBlocks
from kvd.kv.geometry import POOL_DTYPES, GeometryError, canonical_dtype
from kvd.kv.ledger import BudgetMode, tenant_name_problem
from kvd.kv.scope import SharingPolicy
from kvd.units import SizeError, parse_size


class ConfigError(ValueError):
    """The configuration is invalid; the message names the file and the key."""


DEFAULT_MAX_N = 16  # choices one request may ask for (server.max_n)


class ServerSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    listen: str = "127.0.0.1:8000"
    metrics_listen: str = "127.0.0.1:9464"  # Prometheus /metrics (all tenants' figures)
    max_in_flight: int = 4096  # requests with a client, beyond which 503 (overloaded)
    max_n: int = DEFAULT_MAX_N  # choices (the API's n) one request may ask for
    admin_socket: str = "/run/kvd/admin.sock"
    admin_socket_mode: str = "0660"
    admin_group: str | None = None
    state_file: str = "/var/lib/kvd/state.json"  # admin changes, kept across restarts
    drain_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    hard_deadline: float = 1.5  # seconds after the drain timeout before exiting regardless
    max_body: str = "1MiB"
    log_prompts: bool = False  # prompt and completion text in the logs (off: privacy)
    queue_timeout: float | None = 600.0  # seconds a request may wait to start; None: forever
    step_log_interval: float = 10.0  # seconds between engine.step summaries
    # A step that has not come back after this long means a hung or lost
    # device: the engine has failed (below systemd's WatchdogSec, so kvd
    # answers its clients before the watchdog kills it).
    step_timeout: float = 20.0


class ModelSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # "gemma3-270m" (embedded), a .gguf file, a checkpoint directory, or
    # "random": a tiny random-weight Gemma 3 with the embedded tokenizer, for
    # exercising the daemon without model cost (like vLLM's dummy weights).
    source: str = "gemma3-270m"
    name: str | None = None  # the id clients send as "model"; default: the source's name
    dtype: str = EngineDefaults.DTYPE
    # "int8": matrices kept at their stored precision (a GGUF's blocks, exactly)
    # and dequantised inside each step; "none": loaded as dtype; "auto": int8
    # on the CPU where that is exact (a GGUF stored in block formats, the
    # embedded model), the float load on an accelerator (faster there).
    quantization: str = "auto"
    kv_dtype: str | None = None
    max_model_len: int = EngineDefaults.MAX_MODEL_LEN
    max_num_seqs: int = EngineDefaults.MAX_NUM_SEQS
    max_num_batched_tokens: int = EngineDefaults.MAX_NUM_BATCHED_TOKENS
    tensor_parallel: int = EngineDefaults.TENSOR_PARALLEL  # devices to split the model over
    # The attention implementation: "auto" (the Pallas kernel on a TPU, the
    # jnp reference elsewhere), "reference", "pallas" or "pallas-interpret".
    attention: str = EngineDefaults.ATTENTION
    # The matrix products: "xla" (XLA's, f32 activations: the reference
    # numbers), "onednn" (bf16 on oneDNN's AMX or AVX-512 BF16 kernels, on
    # one CPU device; kvd/engine/onednn.py) or "auto" (onednn where it can run).
    matmul: str = "xla"


class PoolSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    size: str = "auto"  # "auto" or a byte size
    auto_fraction: float = 0.5  # of the memory left after the weights, for "auto"
    block_size: int = EngineDefaults.BLOCK_SIZE
    # The host cache: evicted cached blocks kept in host memory.
    # Set, it is the ONE host budget swapped-out sequences share with it
    # (scheduler.swap_space is then not used); "0": off.
    host_size: str = "0"


class BudgetSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    mode: BudgetMode = BudgetMode.RESERVE
    preemption: str = "auto"  # "auto" (measured cost model), "recompute" or "swap"


class SchedulerSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # A step's predicted time (the calibrated cost model) stays under this:
    # prefill chunks shrink to fit after the decodes. None: a step is bounded
    # by model.max_num_batched_tokens alone.
    target_step_ms: float | None = None
    swap_space: str = "4GiB"  # host memory swapped-out sequences may hold, all tenants
    # Plan and dispatch each step before reading the one before it (the
    # device never waits for the host's bookkeeping); false: one at a time.
    overlap: bool = True


class SharingSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    policy: SharingPolicy = SharingPolicy.PUBLIC


class KVEventsSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """KV-cache events for an inference gateway, in vLLM's format and
    transport (docs/howto/scale-out.md): a ZMQ PUB socket, a ROUTER for replays."""

    enable: bool = False
    # Bound (tcp://*:5557, ipc://, a wildcard host) or connected to (a
    # gateway's own socket, tcp://host:5557), as vLLM decides.
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # a ROUTER, always bound; None: no replays
    topic: str = ""  # the first frame of every message
    buffer_steps: int = 10_000  # batches kept for replays
    max_queue: int = 10_000  # batches waiting for the publisher thread; past it, a resync
    private_blocks: PrivateBlocks = PrivateBlocks.TOKEN_IDS
    # Each event as an array in vLLM's field order (llm-d decodes only these;
    # Dynamo both) or as a map tagged by "type" (newer vLLM).
    encoding: EventEncoding = EventEncoding.ARRAY


class DistributedSection(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One kvd over several processes (the hosts of a slice), on JAX's
    multi-controller runtime (docs/howto/multi-host.md). Every process runs
    ``kvd serve`` with the same configuration; process 0 serves."""

    # HOST:PORT where process 0 runs JAX's coordination service, or "auto":
    # all three from the runtime (a TPU slice's metadata).
    coordinator: str = ""
    num_processes: int = 0
    process_id: int | None = None  # or kvd serve --process-id N
    heartbeat_timeout: float = 10.0  # s without a process's heartbeats: it is lost
    join_timeout: float = 300.0  # s to wait for every process to join
    cpu_collectives: str = "gloo"  # between processes' CPU devices: "gloo" or "mpi"


class PrefixEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    text: str | None = None  # tokenized like a prompt (with BOS)
    token_file: str | None = None  # JSON array of ids, or ids separated by whitespace
    chat_system: str | None = None  # a chat system message, as the chat template renders it


class TenantEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    api_key_sha256: str  # hex digest of the bearer key; the key itself is never stored
    reservation: str = "0"  # guaranteed pages: bytes ("256MiB") or a share ("25%")
    burst_cap: str | None = None  # most pages at once; None: the whole pool
    tier: str | None = None  # default: the most important tier
    weight: float = 1.0  # fair-share weight
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    max_queue: int = 64
    swap: str | None = None  # host swap it may hold: bytes or a share of swap_space; None: all
    # Host-cache pages its cached blocks may hold: bytes or a share of pool.host_size; None: all.
    host_quota: str | None = None


class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    server: ServerSection = ServerSection()
    model: ModelSection = ModelSection()
    pool: PoolSection = PoolSection()
    budget: BudgetSection = BudgetSection()
    scheduler: SchedulerSection = SchedulerSection()
    sharing: SharingSection = SharingSection()
    kv_events: KVEventsSection = KVEventsSection()
    distributed: DistributedSection | None = None  # absent: one process
    tiers: list[str] = msgspec.field(default_factory=lambda: ["interactive", "batch"])
    prefixes: list[PrefixEntry] = msgspec.field(default_factory=list)
    tenants: list[TenantEntry] = msgspec.field(default_factory=list)
    base_dir: str = ""  # set by load_config: where relative paths start

    @property
    def served_model(self) -> str:
        if self.model.name:
            return self.model.name
        source = self.model.source
        return source if "/" not in source else Path(source).name.removesuffix(".gguf")

    def path(self, value: str) -> Path:
        return (Path(self.base_dir) / value).resolve()


_HEX64 = re.compile(r"[0-9a-f]{64}")


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_config(path: str | Path) -> Config:
    """Read and validate a configuration file; raises ConfigError."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    if "base_dir" in raw:
        raise ConfigError(f"{path}: unknown key 'base_dir'")
    raw["base_dir"] = str(path.resolve().parent)
    try:
        config = msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {_readable(str(exc))}") from None
    try:
        validate(config)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return config


def _readable(message: str) -> str:
    """msgspec says '... - at `$.tenants[0].weight`'; name the key TOML-style."""
    match = re.search(r" - at `\$\.?(.*)`$", message)
    if not match:
        return message
    return f"{match.group(1) or 'top level'}: {message[: match.start()]}"


def validate(config: Config) -> None:
    """Checks that need more than one key (what types alone cannot say)."""
    server, model, pool = config.server, config.model, config.pool
    _address(server.listen, "server.listen")
    _address(server.metrics_listen, "server.metrics_listen")
    _positive("server.max_in_flight", server.max_in_flight)
    _positive("server.max_n", server.max_n)
    _mode(server.admin_socket_mode)
    _positive("server.drain_timeout", server.drain_timeout, allow_zero=True)
    _positive("server.hard_deadline", server.hard_deadline)
    _positive("server.step_timeout", server.step_timeout)
    if server.queue_timeout is not None:
        _positive("server.queue_timeout", server.queue_timeout)
    _positive("server.step_log_interval", server.step_log_interval)
    _size("server.max_body", server.max_body)
    if model.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.dtype: {model.dtype!r} is not float32 or bfloat16")
    if model.quantization not in ("auto", "none", "int8"):
        raise ConfigError(f"model.quantization: {model.quantization!r} is not auto, none or int8")
    if model.kv_dtype is not None and _canonical_or_none(model.kv_dtype) not in POOL_DTYPES:
        raise ConfigError(
            f"model.kv_dtype: {model.kv_dtype!r} is not one of {', '.join(POOL_DTYPES)}"
        )
    if model.attention not in ATTENTION_CHOICES:
        raise ConfigError(
            f"model.attention: {model.attention!r} is not one of {', '.join(ATTENTION_CHOICES)}"
        )
    if model.matmul not in MATMUL_CHOICES:
        raise ConfigError(
            f"model.matmul: {model.matmul!r} is not one of {', '.join(MATMUL_CHOICES)}"
        )
    for key in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel"):
        _positive(f"model.{key}", getattr(model, key))
    _positive("pool.block_size", pool.block_size)
    if pool.size != "auto":
        _size("pool.size", pool.size)
    if pool.host_size.strip() != "0":
        _size("pool.host_size", pool.host_size)
    if not 0 < pool.auto_fraction <= 1:
        raise ConfigError("pool.auto_fraction: must be in (0, 1]")
    if config.scheduler.target_step_ms is not None:
        _positive("scheduler.target_step_ms", config.scheduler.target_step_ms)
    _size("scheduler.swap_space", config.scheduler.swap_space)
    if config.budget.preemption not in ("auto", "recompute", "swap"):
        raise ConfigError("budget.preemption: must be 'auto', 'recompute' or 'swap'")
    _kv_events(config.kv_events)
    if config.distributed is not None:
        _distributed(config.distributed)
    if not config.tiers or len(set(config.tiers)) != len(config.tiers):
        raise ConfigError("tiers: must be a non-empty list of distinct names")
    names: set[str] = set()
    for prefix in config.prefixes:
        if prefix.name in names:
            raise ConfigError(f"prefixes: the name {prefix.name!r} is used twice")
        names.add(prefix.name)
        given = [prefix.text, prefix.token_file, prefix.chat_system]
        if sum(value is not None for value in given) != 1:
            raise ConfigError(
                f"prefixes.{prefix.name}: give exactly one of text, token_file, chat_system"
            )
    tenants: set[str] = set()
    digests: set[str] = set()
    for tenant in config.tenants:
        where = f"tenants.{tenant.name}"
        problem = tenant_name_problem(tenant.name)
        if problem is not None:
            raise ConfigError(f"{where}: {problem}")
        if tenant.name in tenants:
            raise ConfigError(f"{where}: the tenant is defined twice")
        tenants.add(tenant.name)
        if not _HEX64.fullmatch(tenant.api_key_sha256):
            raise ConfigError(f"{where}.api_key_sha256: not a lowercase hex SHA-256 digest")
        if tenant.api_key_sha256 in digests:
            raise ConfigError(f"{where}.api_key_sha256: another tenant has the same key")
        digests.add(tenant.api_key_sha256)
        if tenant.tier is not None and tenant.tier not in config.tiers:
            raise ConfigError(f"{where}.tier: unknown tier {tenant.tier!r}")
        _positive(f"{where}.weight", tenant.weight)
        _positive(f"{where}.max_queue", tenant.max_queue)
        for key in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(tenant, key)
            if value is not None:
                _positive(f"{where}.{key}", value)
        _share(f"{where}.reservation", tenant.reservation)
        if tenant.burst_cap is not None:
            _share(f"{where}.burst_cap", tenant.burst_cap)
        if tenant.swap is not None:
            _share(f"{where}.swap", tenant.swap)
        if tenant.host_quota is not None:
            _share(f"{where}.host_quota", tenant.host_quota)
    if not config.tenants:
        raise ConfigError("tenants: at least one tenant is needed to serve anyone")


_ZMQ_ENDPOINT = re.compile(r"(tcp://[^\s]+:(\d+|\*)|ipc://\S+|inproc://\S+)")


def _kv_events(section: KVEventsSection) -> None:
    for key in ("endpoint", "replay_endpoint"):
        value = getattr(section, key)
        if value is not None and not _ZMQ_ENDPOINT.fullmatch(value):
            raise ConfigError(
                f"kv_events.{key}: {value!r} is not a ZMQ endpoint "
                "(tcp://HOST:PORT, ipc://PATH or inproc://NAME)"
            )
    if section.replay_endpoint == section.endpoint and not section.endpoint.endswith(":*"):
        raise ConfigError("kv_events.replay_endpoint: must differ from kv_events.endpoint")
    _positive("kv_events.buffer_steps", section.buffer_steps)
    _positive("kv_events.max_queue", section.max_queue)


def _distributed(section: DistributedSection) -> None:
    _positive("distributed.heartbeat_timeout", section.heartbeat_timeout)
    _positive("distributed.join_timeout", section.join_timeout)
    if section.cpu_collectives not in ("gloo", "mpi"):
        raise ConfigError(
            f"distributed.cpu_collectives: {section.cpu_collectives!r} is not gloo or mpi"
        )
    # The id may come from the command line: checked here only when given.
    placeholder = section.coordinator != "auto" and section.process_id is None
    resolve_distributed(section, 0 if placeholder else None)


def resolve_distributed(
    section: DistributedSection, process_id: int | None
) -> tuple[str | None, int | None, int | None]:
    """(coordinator, processes, this process's id) for
    ``jax.distributed.initialize``: None where JAX is to read it from the
    runtime (``coordinator = "auto"`` on a TPU slice). ConfigError, one line,
    for a set it cannot start."""
    pid = process_id if process_id is not None else section.process_id
    if section.coordinator == "auto":
        if section.num_processes or pid is not None:
            raise ConfigError(
                "distributed: with coordinator = 'auto' the process count and id come from "
                "the runtime; leave num_processes, process_id and --process-id out"
            )
        return None, None, None
    if not section.coordinator:
        raise ConfigError(
            "distributed.coordinator: missing (HOST:PORT of process 0, or 'auto' on a TPU slice)"
        )
    host, _, port = section.coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"distributed.coordinator: {section.coordinator!r} is not HOST:PORT or 'auto'"
        )
    if section.num_processes < 1:
        raise ConfigError("distributed.num_processes: must be at least 1")
    if pid is None:
        raise ConfigError(
            "distributed.process_id: missing (set it, or run kvd serve --process-id N)"
        )
    if not 0 <= pid < section.num_processes:
        raise ConfigError(
            f"distributed.process_id: {pid} is out of range for "
            f"{section.num_processes} processes (0 to {section.num_processes - 1})"
        )
    return section.coordinator, section.num_processes, pid


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if not math.isfinite(value):
        raise ConfigError(f"{key}: must be a finite number, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}: must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def _canonical_or_none(dtype: str) -> str | None:
    try:
        return canonical_dtype(dtype)
    except GeometryError:
        return None


def _size(key: str, value: str) -> int:
    try:
        return parse_size(value)
    except SizeError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def _share(key: str, value: str) -> None:
    if value.endswith("%"):
        fraction = _percent(key, value)
        if not 0 <= fraction <= 1:
            raise ConfigError(f"{key}: a share of the pool must be between 0% and 100%")
    elif value != "0":
        _size(key, value)


def _percent(key: str, value: str) -> Decimal:
    try:
        return Decimal(value[:-1]) / 100
    except InvalidOperation:
        raise ConfigError(f"{key}: {value!r} is not a percentage") from None


def _mode(value: str) -> int:
    if not re.fullmatch(r"0?[0-7]{3}", value):
        raise ConfigError(f"server.admin_socket_mode: {value!r} is not an octal mode like 0660")
    return int(value, 8)


def _address(value: str, key: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{key}: {value!r} is not HOST:PORT")
    return host, int(port)


def parse_listen(value: str) -> tuple[str, int]:
    return _address(value, "listen")


def socket_mode(config: Config) -> int:
    return _mode(config.server.admin_socket_mode)


def body_limit(config: Config) -> int:
    return _size("server.max_body", config.server.max_body)


def pages_of(key: str, value: str, page_bytes: int, pool_pages: int) -> int:
    """A budget in pages: a share of the pool, or bytes rounded down to pages."""
    if value.endswith("%"):
        return int(_percent(key, value) * pool_pages)
    if value == "0":
        return 0
    return _size(key, value) // page_bytes


def read_token_file(path: Path) -> list[int]:
    """Token ids from a JSON array or whitespace-separated integers."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    try:
        ids = (
            msgspec.json.decode(text, type=list[int])
            if text.lstrip().startswith("[")
            else [int(part) for part in text.split()]
        )
    except (msgspec.DecodeError, ValueError):
        raise ConfigError(
            f"{path}: not a JSON array of token ids nor ids separated by spaces"
        ) from None
    return ids
