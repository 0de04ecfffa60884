"""The package's import graph: no circle (a module-level or a deferred
import alike), between modules or between packages; packages depend one
way (kv <- sched <- engine <- oneshot, server <- bench, cli); and the
scheduler and KV manager free of JAX."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvd"
KERNELS = ROOT / "kernels"  # a source root of its own, holding kvd_kernels

# Each package imports only packages of a lower rank (kvd's own modules of
# one concept, faults/units/clikit, sit below them all).
RANKS = {
    "kvd_kernels": 0,  # pure functions over arrays: a leaf
    "kvd.kv": 1,
    "kvd.sched": 2,
    "kvd.engine": 3,
    "kvd.oneshot": 4,
    "kvd.server": 4,
    "kvctl.admin": 5,  # the admin socket's client, which the benchmarks drive too
    "kvd.bench": 6,
    "kvd.experiments": 7,
    "kvd.cli": 8,
    "kvctl.cli": 9,
}


def _module_name(path: Path) -> str:
    root = KERNELS if path.is_relative_to(KERNELS) else ROOT
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "kvctl").rglob("*.py"), *KERNELS.rglob("*.py")]
    modules = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circle() -> None:
    graph = import_graph()
    assert "kvd.server.scheduling" in graph["kvd.server.admin"]  # the graph sees real edges
    # A package's __init__ importing its own modules is not a circle of ideas.
    for name in graph:
        if name.count(".") == 1:
            graph[name] = {t for t in graph[name] if not t.startswith(name + ".")}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def package_of(module: str) -> str:
    """``kvd.sched.book`` -> ``kvd.sched``; a top-level module (``kvd.cli``,
    ``kvctl.admin``) is its own; ``kvd_kernels`` is one package."""
    if module.split(".")[0] == "kvd_kernels":
        return "kvd_kernels"
    return ".".join(module.split(".")[:2])


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        mine = package_of(module)
        graph.setdefault(mine, set()).update(
            other for other in map(package_of, targets) if other != mine
        )
    return graph


def test_packages_depend_one_way() -> None:
    graph = package_graph()
    assert "kvd.kv" in graph["kvd.sched"]  # the graph sees real edges
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])
    uphill = sorted(
        f"{package} imports {other}"
        for package, others in graph.items()
        for other in others
        if other in RANKS and RANKS[other] >= RANKS.get(package, 0)
    )
    assert not uphill, uphill
    # Besides the ranked: the packages' __init__ modules and kvd's one-concept
    # modules (faults, units, clikit), which import no ranked package.
    unranked = {p for p in graph if p not in RANKS}
    assert unranked <= {"kvd", "kvctl", "kvd.faults", "kvd.units", "kvd.clikit"}, unranked
    assert not any(graph[p] & RANKS.keys() for p in unranked), {p: graph[p] for p in unranked}


def test_the_kernels_are_a_top_level_leaf_the_engine_uses() -> None:
    """kernels/ beside kvd/ (the design card's layout) holds kvd_kernels; it
    leaves the import name kernels to Hugging Face's, which transformers
    requires, so kernels/ itself is no package."""
    graph = import_graph()
    assert not (KERNELS / "__init__.py").exists()
    kernel = "kvd_kernels.ragged_paged_attention"
    assert kernel in graph
    assert not (PACKAGE / "engine" / "kernels").exists()
    for path in KERNELS.rglob("*.py"):  # not even a deferred import of kvd
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] in ("kvd", "kvctl") for n in names), (path, names)
    assert kernel in graph["kvd.engine.attention"]


def test_the_scheduler_and_kv_core_import_no_jax() -> None:
    code = (
        "import sys, kvd.kv, kvd.sched, kvd.sched.scheduler, kvd.oneshot.batch, "
        "kvd.sched.simulated, kvd.sched.costmodel; "
        "assert 'jax' not in sys.modules, 'jax imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_server_core_imports_no_jax() -> None:
    """The runtime, the API bodies, the apps and the daemon run on the
    simulated executor without JAX (the engine's loader is imported when used)."""
    code = (
        "import sys, kvd.server.api, kvd.server.runtime, kvd.server.http, "
        "kvd.server.admin, kvd.server.daemon, kvd.server.responses; "
        "sys.exit('jax' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_the_kv_manager_and_the_scheduler_are_composed_not_inherited() -> None:
    """Each holds its parts as objects: no class of kvd's own in its MRO."""
    from kvd.kv.manager import KVManager
    from kvd.sched.scheduler import Scheduler

    for cls in (KVManager, Scheduler):
        inherited = [c.__qualname__ for c in cls.__mro__[1:] if c.__module__.startswith("kvd")]
        assert not inherited, (cls.__name__, inherited)


KV_PARTS = {"pool", "ledger", "host", "columns", "registry"}


def _names_a_kv_manager(node: ast.expr) -> bool:
    """``kv``, ``self.kv``, ``scheduler.kv``, ``kv2``...: how kvd names a KV manager."""
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return name.startswith("kv") and name[2:].isdigit() or name in ("kv", "_kv")


def test_outside_the_kv_core_nobody_reads_the_kv_managers_parts() -> None:
    """Code outside kvd/kv asks the manager (stats, step_columns, tenant...)."""
    reads = []
    files = [
        *PACKAGE.rglob("*.py"),
        *(ROOT / "kvctl").rglob("*.py"),
        *(ROOT / "scripts").glob("*.py"),
    ]
    for path in files:
        if path.is_relative_to(PACKAGE / "kv"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in KV_PARTS
                and _names_a_kv_manager(node.value)
            ):
                reads.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not reads, reads
    probe = ast.parse("kv.pool.free; self.kv.ledger; scheduler.kv.registry.host")
    seen = [
        n.attr
        for n in ast.walk(probe)
        if isinstance(n, ast.Attribute) and n.attr in KV_PARTS and _names_a_kv_manager(n.value)
    ]
    assert sorted(seen) == ["ledger", "pool", "registry"], seen  # the check sees such reads


def test_the_kv_manager_aliases_nothing_of_its_registry() -> None:
    from kvd.kv.geometry import preset
    from kvd.kv.layout import build_layout
    from kvd.kv.manager import KVManager

    kv = KVManager(build_layout(preset("gemma3-270m"), 16), 64)
    registry = vars(kv.registry)
    aliased = [
        name
        for name, value in vars(kv).items()
        if name != "registry"
        and not isinstance(value, int | str)
        and any(value is held for held in registry.values())
        and value is not kv.layout
    ]
    assert not aliased, aliased


BOOK_WRITES = {"append", "appendleft", "pop", "popleft", "remove", "add", "discard", "clear",
               "setdefault", "update", "extend"}  # fmt: skip


def test_the_scheduler_changes_the_book_only_through_its_methods() -> None:
    """No scheduler part assigns to a table of the request book, or changes
    one in place: ``book.running[...] = ...``, ``book.queues[t].append(...)``."""

    def book_table(node: ast.expr) -> bool:  # book.X, self.book.X, book.X[...]
        while isinstance(node, ast.Subscript):
            node = node.value
        return isinstance(node, ast.Attribute) and (
            isinstance(node.value, ast.Name)
            and node.value.id == "book"
            or isinstance(node.value, ast.Attribute)
            and node.value.attr == "book"
        )

    writes = []
    for path in (PACKAGE / "sched").glob("*.py"):
        if path.name == "book.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.Delete):
                targets = [node.target] if isinstance(node, ast.AugAssign) else node.targets
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in BOOK_WRITES
            ):
                targets = [node.func.value]
            writes += [f"{path.name}:{node.lineno}" for t in targets if book_table(t)]
    assert not writes, writes
    # And no alias of a book table hides one: the scheduler holds none of them.
    from kvd.sched.scheduler import Scheduler
    from tests.sched.simulated import make_executor

    scheduler = Scheduler(make_executor())
    book = vars(scheduler.book)
    tables = [v for k, v in book.items() if k not in ("kv", "swap_space", "clock")]
    aliased = [name for name, value in vars(scheduler).items() if any(value is t for t in tables)]
    assert not aliased, aliased
