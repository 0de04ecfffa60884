import pytest

from kvd.kv import SHARED_ACCOUNT, BudgetError, BudgetMode, Ledger, TenantBudget


def test_reservations_cannot_sum_past_the_pool() -> None:
    ledger = Ledger(100)
    ledger.set_tenant("a", TenantBudget(reservation=60))
    with pytest.raises(BudgetError, match="total 101 pages .* pool has 100 pages"):
        ledger.set_tenant("b", TenantBudget(reservation=41))
    assert "b" not in ledger.accounts
    ledger.set_tenant("b", TenantBudget(reservation=40))
    ledger.set_tenant("a", TenantBudget(reservation=50))  # lowering is always fine
    assert ledger.total_reserved() == 90


def test_public_bound_counts_with_reservations() -> None:
    ledger = Ledger(100)
    ledger.set_tenant("a", TenantBudget(reservation=90))
    with pytest.raises(BudgetError, match="public prefixes may pin 11 pages"):
        ledger.set_public_bound(11)
    ledger.set_public_bound(10)
    with pytest.raises(BudgetError):
        ledger.set_tenant("a", TenantBudget(reservation=91))


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        (TenantBudget(reservation=-1), "must not be negative"),
        (TenantBudget(reservation=10, cap=5), "below the reservation"),
        (TenantBudget(cap=101), "exceeds the pool"),
    ],
)
def test_bad_budgets(budget: TenantBudget, message: str) -> None:
    with pytest.raises(BudgetError, match=message):
        Ledger(100).set_tenant("a", budget)


def test_bad_names_and_removal() -> None:
    ledger = Ledger(10)
    for name in ("", "@shared", "@x"):
        with pytest.raises(BudgetError, match="invalid tenant name"):
            ledger.set_tenant(name, TenantBudget())
    ledger.set_tenant("a", TenantBudget())
    ledger.accounts["a"].used = 3
    with pytest.raises(BudgetError, match="still holds 3 pages"):
        ledger.remove_tenant("a")
    ledger.accounts["a"].used = 0
    ledger.remove_tenant("a")
    with pytest.raises(BudgetError, match="unknown tenant"):
        ledger.remove_tenant("a")
    assert SHARED_ACCOUNT in ledger.accounts


def test_headroom_surplus_and_shortfall_by_mode() -> None:
    ledger = Ledger(100)
    ledger.set_tenant("a", TenantBudget(reservation=20, cap=50))
    ledger.accounts["a"].used = 30
    assert (ledger.headroom("a"), ledger.surplus("a"), ledger.shortfall("a")) == (20, 10, 0)
    ledger.set_mode(BudgetMode.STATIC)
    assert (ledger.headroom("a"), ledger.surplus("a"), ledger.shortfall("a")) == (-10, 10, 0)
    ledger.set_mode(BudgetMode.FREE)
    assert (ledger.headroom("a"), ledger.surplus("a"), ledger.shortfall("a")) == (70, 30, 0)
    ledger.set_mode(BudgetMode.RESERVE)
    ledger.accounts["a"].used = 5
    assert ledger.shortfall("a") == 15
