"""The seed's machine: Gemma 4 12B's KV geometry in a ~3.8 GiB pool (seed 000),
which the experiments run at through the KV core alone (no weights needed)."""

from __future__ import annotations

from kvd.kv.geometry import KVGeometry, preset
from kvd.units import parse_size

SEED_MODEL = "gemma4-12b"
SEED_POOL = "3.8GiB"


def seed_geometry() -> KVGeometry:
    return preset(SEED_MODEL)


def seed_pool_bytes() -> int:
    return parse_size(SEED_POOL)
