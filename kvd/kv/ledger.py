"""Per-tenant accounts of pool pages, and the three budget modes.

Who pays for a page (every *referenced* page is charged to exactly one account):

- a page registered under the public scope (an operator-registered public
  prefix) is charged to the ``@shared`` account, whichever tenants use it;
- any other page is charged to the first tenant still holding it: its
  allocator, and when that tenant lets go while others still hold it (only
  possible under the ``shared`` policy), the longest-standing remaining holder.

Pages nobody references (free, or cached and reusable in LRU order) are idle
capacity and charged to nobody: any allocation may take them.

Under ``shared`` a tenant that holds a page another tenant paid for becomes
its payer when that tenant lets go, even past its own cap: it then cannot
grow until it is back under, and the excess is surplus others may reclaim.
The reservation guarantee is exact for the ``isolated`` and ``public``
policies; under ``shared`` it counts pages a tenant holds through sharing.

Modes:

- ``free``: first come, first served; reservations and caps are not enforced.
- ``static``: a tenant's reservation is a hard partition: it may never hold
  more, and (because partitions never sum past the pool) it can always get
  that much from idle pages.
- ``reserve`` (default): the reservation is guaranteed, and a tenant may burst
  up to its cap using idle pages. Pages above the reservation are surplus:
  reclaimable by a tenant that is below its own reservation.

Reservations always sum, with the pages public prefixes may pin, to at most the
pool; that is what makes the guarantee keepable and is checked on every change.
"""

from __future__ import annotations

import enum
import re

import msgspec

SHARED_ACCOUNT = "@shared"
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def tenant_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a tenant (the one check, for config, admin
    API and ledger alike), or None. Names are safe in logs, metrics labels and
    paths; the ledger's own accounts ("@shared") cannot collide with them."""
    if not _TENANT_NAME.fullmatch(name):
        return f"invalid tenant name {name!r}: 1-64 letters, digits, '_', '.', '-', not first"
    return None


class BudgetMode(enum.StrEnum):
    FREE = "free"
    STATIC = "static"
    RESERVE = "reserve"


class BudgetError(ValueError):
    """A budget change that the pool cannot honour; the message carries the numbers."""


class TenantBudget(msgspec.Struct, frozen=True):
    """A tenant's page budget. ``cap`` None means the whole pool."""

    reservation: int = 0
    cap: int | None = None


class Account:
    """Pages charged to one tenant (or to the shared account) right now."""

    __slots__ = ("name", "reservation", "cap", "used")

    def __init__(self, name: str, reservation: int, cap: int | None) -> None:
        self.name = name
        self.reservation = reservation
        self.cap = cap
        self.used = 0

    def __repr__(self) -> str:
        return f"Account({self.name!r}, used={self.used}, res={self.reservation}, cap={self.cap})"


class Ledger:
    """Budgets and charges. ``capacity`` is the number of allocatable pages."""

    def __init__(self, capacity: int, mode: BudgetMode = BudgetMode.RESERVE) -> None:
        if capacity < 1:
            raise BudgetError("the pool needs at least one allocatable page")
        self.capacity = capacity
        self.mode = mode
        self.public_bound = 0  # most pages the shared account can be charged
        self.accounts: dict[str, Account] = {SHARED_ACCOUNT: Account(SHARED_ACCOUNT, 0, None)}

    # -- budgets -------------------------------------------------------------

    def set_tenant(self, name: str, budget: TenantBudget) -> None:
        """Create or change a tenant's budget; refuses what the pool cannot honour.

        Lowering a reservation or cap below current use is allowed: the excess
        becomes surplus (reclaimable) and the tenant cannot grow until under it.
        """
        problem = tenant_name_problem(name)
        if problem is not None:
            raise BudgetError(problem)
        if budget.reservation < 0:
            raise BudgetError(f"reservation must not be negative, got {budget.reservation}")
        if budget.cap is not None and budget.cap < budget.reservation:
            raise BudgetError(
                f"cap {budget.cap} pages is below the reservation {budget.reservation} pages"
            )
        if budget.cap is not None and budget.cap > self.capacity:
            raise BudgetError(f"cap {budget.cap} pages exceeds the pool ({self.capacity} pages)")
        others = sum(a.reservation for n, a in self.accounts.items() if n != name)
        self._check_fits(others + budget.reservation, self.public_bound)
        account = self.accounts.get(name)
        if account is None:
            self.accounts[name] = Account(name, budget.reservation, budget.cap)
        else:
            account.reservation, account.cap = budget.reservation, budget.cap

    def remove_tenant(self, name: str) -> None:
        account = self.tenant(name)
        if account.used:
            raise BudgetError(f"tenant {name!r} still holds {account.used} pages")
        del self.accounts[name]

    def set_mode(self, mode: BudgetMode) -> None:
        self.mode = BudgetMode(mode)

    def set_public_bound(self, pages: int) -> None:
        """Declare how many pages registered public prefixes may pin at most."""
        self._check_fits(self.total_reserved(), pages)
        self.public_bound = pages

    def _check_fits(self, reserved: int, public: int) -> None:
        if reserved + public > self.capacity:
            raise BudgetError(
                f"reservations would total {reserved} pages and public prefixes may pin "
                f"{public} pages, {reserved + public} in all, but the pool has "
                f"{self.capacity} pages"
            )

    def total_reserved(self) -> int:
        return sum(a.reservation for a in self.accounts.values())

    # -- charges (called by the page pool) ----------------------------------

    def account(self, name: str) -> Account:
        return self.accounts[name] if name == SHARED_ACCOUNT else self.tenant(name)

    def tenant(self, name: str) -> Account:
        try:
            return self.accounts[name]
        except KeyError:
            raise BudgetError(f"unknown tenant {name!r}") from None

    # -- queries -------------------------------------------------------------

    def headroom(self, name: str) -> int:
        """Pages the tenant may still be charged before its budget says no."""
        account = self.tenant(name)
        if self.mode is BudgetMode.FREE:
            return self.capacity - account.used
        if self.mode is BudgetMode.STATIC:
            return account.reservation - account.used
        limit = self.capacity if account.cap is None else account.cap
        return limit - account.used

    def most(self, name: str) -> tuple[int, str]:
        """(the most pages the tenant may ever hold in this mode, what sets it)."""
        account = self.tenant(name)
        if self.mode is BudgetMode.STATIC:
            return account.reservation, "your reservation (the budget is static)"
        if self.mode is BudgetMode.RESERVE and account.cap is not None:
            return account.cap, "your burst cap"
        return self.capacity, "the pool"

    def shortfall(self, name: str) -> int:
        """Pages the tenant is below its guarantee (0 in free mode)."""
        if self.mode is BudgetMode.FREE:
            return 0
        account = self.tenant(name)
        return max(0, account.reservation - account.used)

    def surplus(self, name: str) -> int:
        """Pages above the guarantee, i.e. reclaimable (everything in free mode)."""
        account = self.tenant(name)
        if self.mode is BudgetMode.FREE:
            return account.used
        return max(0, account.used - account.reservation)
