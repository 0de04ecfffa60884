"""Who may hit whose cached blocks: sharing policies, scopes and the block hash.

A full block is keyed by ``H(parent hash, scope, tokens)``. The scope enters
*every* block of the chain, so a block that follows a public prefix is still
scoped to its tenant. H is BLAKE2b keyed with a secret drawn at start-up: a
tenant cannot precompute a collision with another tenant's block, and the key
never leaves the process (hashes are not persisted, so no stable key is needed).

Policies (switchable live; a switch changes the scope of future lookups, and
blocks cached under the old scopes simply stop being reachable):

- ``isolated``: every tenant (and every ``cache_salt`` within it) is its own
  scope; registered public prefixes are scoped too. No cross-tenant hit.
- ``public`` (default): operator-registered public prefixes are hashed in the
  one ``public`` scope and shared by every tenant; everything after them is the
  tenant's. The only cross-tenant hits are on text the operator declared public.
- ``shared``: one scope for all tenants (``cache_salt`` still splits it). For
  mutually trusting tenants only: it reopens the timing side channel.

A ``cache_salt`` scopes a request's tenant-supplied blocks further; it does
not apply to public-prefix blocks, whose content is public by declaration.
"""

from __future__ import annotations

import enum
import hashlib
import os
from array import array
from collections.abc import Sequence

import msgspec


class SharingPolicy(enum.StrEnum):
    ISOLATED = "isolated"
    PUBLIC = "public"
    SHARED = "shared"


_HASH_KEY = os.urandom(32)
_ROOT = b"\x00" * 32
PUBLIC_SCOPE = msgspec.msgpack.encode(("public",))


class Scope(msgspec.Struct, frozen=True):
    """The scope of each full block of one request's token chain.

    Blocks ``[0, public_blocks)`` are hashed in the public scope; the rest in
    ``private``. ``public_matches`` lists every registered public prefix the
    request starts with, as (name, registration id, full blocks), longest
    first. Registration ids tell a prefix re-added under an old name apart.
    """

    private: bytes
    public_matches: tuple[tuple[str, int, int], ...] = ()

    @property
    def public_blocks(self) -> int:
        return self.public_matches[0][2] if self.public_matches else 0

    @property
    def public_prefix(self) -> str | None:
        return self.public_matches[0][0] if self.public_matches else None

    def of_block(self, index: int) -> bytes:
        return PUBLIC_SCOPE if index < self.public_blocks else self.private

    def prefixes_covering(self, index: int) -> frozenset[int]:
        """Registration ids of the matched prefixes that contain block ``index``."""
        return frozenset(rid for _, rid, blocks in self.public_matches if index < blocks)


def tenant_scope(policy: SharingPolicy, tenant: str, cache_salt: str | None) -> bytes:
    """The scope bytes of a tenant's own (non-public) blocks under a policy."""
    if policy is SharingPolicy.SHARED:
        return msgspec.msgpack.encode(("shared", cache_salt))
    return msgspec.msgpack.encode(("tenant", tenant, cache_salt))


_KEYED = hashlib.blake2b(key=_HASH_KEY, digest_size=32)  # copied: cheaper than keying again


def block_hash(parent: bytes | None, scope: bytes, tokens: Sequence[int]) -> bytes:
    """The 32-byte keyed hash of one full block, chained on its parent's hash."""
    digest = _KEYED.copy()
    digest.update(parent or _ROOT)
    digest.update(len(scope).to_bytes(4, "little"))
    digest.update(scope)
    digest.update(array("I", tokens).tobytes())
    return digest.digest()


def chain_hashes(
    tokens: Sequence[int],
    block_size: int,
    scope: Scope,
    start: int,
    stop: int,
    parent: bytes | None,
) -> list[bytes]:
    """Hashes of full blocks ``[start, stop)``, continuing from ``parent``."""
    hashes: list[bytes] = []
    for index in range(start, stop):
        parent = block_hash(
            parent, scope.of_block(index), tokens[index * block_size : (index + 1) * block_size]
        )
        hashes.append(parent)
    return hashes


class PublicPrefixes:
    """Operator-registered public prefixes (token sequences), by name.

    Each registration gets a fresh id, so pages cached for a prefix that was
    removed (or replaced under the same name) are never taken for the new one.
    """

    def __init__(self) -> None:
        self._by_name: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._next_id = 1
        self.hits: dict[str, int] = {}  # prefix name -> tokens served from cache

    def add(self, name: str, tokens: Sequence[int]) -> int:
        if not tokens:
            raise ValueError("a public prefix needs at least one token")
        if name in self._by_name:
            raise ValueError(f"a public prefix named {name!r} already exists")
        rid = self._next_id
        self._next_id += 1
        self._by_name[name] = (rid, tuple(tokens))
        self.hits[name] = 0
        return rid

    def remove(self, name: str) -> int:
        """Unregister; returns the registration id that ended."""
        if name not in self._by_name:
            raise KeyError(f"no public prefix named {name!r}")
        rid, _ = self._by_name.pop(name)
        self.hits.pop(name, None)
        return rid

    def items(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(name, tokens) for name, (_, tokens) in self._by_name.items()]

    def live_ids(self) -> frozenset[int]:
        return frozenset(rid for rid, _ in self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def matches(self, tokens: Sequence[int], block_size: int) -> list[tuple[str, int, int]]:
        """Registered prefixes whose leading full blocks ``tokens`` repeat:
        (name, id, how many blocks agree), most blocks first.

        Only full blocks count, and a request may agree with fewer of them
        than the prefix has: a prefix's last tokens can tokenize differently
        once the request's own text follows them (a merge across the
        boundary), and that must cost at most the block it falls in, not the
        whole match. Every block that agrees holds only public tokens.
        """
        found = []
        for name, (rid, prefix) in self._by_name.items():
            blocks = min(len(prefix), len(tokens)) // block_size
            agree = 0
            while agree < blocks:
                start = agree * block_size
                end = start + block_size
                if tuple(tokens[start:end]) != prefix[start:end]:
                    break
                agree += 1
            if agree:
                found.append((name, rid, agree))
        found.sort(key=lambda match: (-match[2], match[0]))
        return found


def resolve_scope(
    policy: SharingPolicy,
    tenant: str,
    cache_salt: str | None,
    tokens: Sequence[int],
    block_size: int,
    public: PublicPrefixes,
) -> Scope:
    """The scope of each block of a request arriving now."""
    private = tenant_scope(policy, tenant, cache_salt)
    if policy is SharingPolicy.ISOLATED:
        return Scope(private)
    return Scope(private, tuple(public.matches(tokens, block_size)))
