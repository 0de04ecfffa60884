"""What the processes of a multi-host set agree on, through JAX's
coordination service (its key-value store): the leader publishes, the
followers wait for it. Also whether this process is ending the set on
purpose (then a process leaving is not a loss). Used by the loader and by
``kvd.server.distributed``; nothing here starts JAX's runtime."""

from __future__ import annotations

import hashlib
import threading

import msgspec

from kvd.server.config import Config, ConfigError

# How long a follower waits for the leader's figures (the leader is loading
# the model meanwhile), in milliseconds.
AGREE_TIMEOUT_MS = 30 * 60 * 1000
_KEY = "kvd/"

_ending = threading.Event()  # this process stops the set, or was told to stop


def ending() -> None:
    """From now on processes leave on purpose: the watch stops reporting them."""
    _ending.set()


def is_ending() -> bool:
    return _ending.is_set()


def config_digest(config: Config) -> str:
    """What every process must load alike: the model section and the pool's
    block size (the rest is the leader's alone)."""
    shared = {"model": config.model, "block_size": config.pool.block_size}
    return hashlib.sha256(msgspec.json.encode(shared)).hexdigest()[:16]


def agree(name: str, value: str | None = None) -> str:
    """The leader's ``value`` for ``name``, on every process: the leader
    publishes it in JAX's coordination service, the others wait for it."""
    import jax
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    assert client is not None  # the set was joined (kvd.server.distributed.start)
    if jax.process_index() == 0:
        assert value is not None
        client.key_value_set(_KEY + name, value)
        return value
    return str(client.blocking_key_value_get(_KEY + name, AGREE_TIMEOUT_MS))


def agree_on_config(config: Config) -> None:
    """Stop a follower whose model or pool settings are not the leader's."""
    mine = config_digest(config)
    leaders = agree("config", mine)
    if leaders != mine:
        raise ConfigError(
            "distributed: this process's [model] or pool.block_size differs from process 0's; "
            "every process runs with the same configuration"
        )
