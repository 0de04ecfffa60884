"""Faults the scheduler recovers from, on the simulated executor (whose pages
hold each position's token and which checks every page a step reads): a
sequence's own inputs failing a step, and device-to-host copies failing.
Each ends with the other requests' exact outputs and a whole pool."""

from __future__ import annotations

from typing import Any

from kvd.kv.scope import SharingPolicy
from kvd.sched.executor import SequenceFault
from kvd.sched.scheduler import Scheduler, SchedulerConfig, TenantConfig
from kvd.sched.simulated import SimulatedExecutor
from tests.sched.simulated import greedy, make_executor
from tests.sched.test_scheduler import Run, expected, prompt


class Faulty:
    """Wraps an executor's methods: the named sequence's inputs fail the steps
    it runs in, and copies out fail while ``copies_fail`` is set."""

    def __init__(self, executor: SimulatedExecutor) -> None:
        self.executor = executor
        self.bad_seq: int | None = None
        self.copies_fail = False
        self.failed_copies = 0
        self.runs_refused = 0
        self._run, self._copy_out = executor.run, executor.copy_out
        executor.run = self.run  # type: ignore[method-assign,assignment]
        executor.copy_out = self.copy_out  # type: ignore[method-assign]

    def run(self, seqs: list[Any], *args: Any) -> Any:
        for i, seq in enumerate(seqs):
            if seq.seq_id == self.bad_seq:
                self.runs_refused += 1
                raise SequenceFault(i, ValueError("its sampling parameters cannot be packed"))
        return self._run(seqs, *args)

    def copy_out(self, pages: list[int]) -> Any:
        if self.copies_fail:
            self.failed_copies += 1
            raise MemoryError("the host is out of memory")
        return self._copy_out(pages)


def test_a_sequence_fault_fails_its_request_alone() -> None:
    executor = make_executor(pages=90)
    faulty = Faulty(executor)
    s = Scheduler(executor)
    s.set_tenant(TenantConfig("t"))
    prompts = {f"r{i}": prompt(20 + i, 10 + 3 * i) for i in range(4)}
    for name, ids in prompts.items():
        s.submit(name, "t", ids, greedy(12))
    run = Run(s)
    while s.book.requests["r2"].seq is None:  # r2 starts; from then on its inputs fail a step
        run.step()
    faulty.bad_seq = s.book.requests["r2"].seq.seq_id
    ended: dict[str, Any] = {}
    for _ in range(500):
        if not s.has_work():
            break
        result = s.step()
        run.results.append(result)
        for event in result.events:
            if event.token is not None:
                run.outputs.setdefault(event.request_id, []).append(event.token)
            if event.finished:
                ended[event.request_id] = event
        s.kv.check_invariants()
    assert ended["r2"].finish_reason == "error" and "cannot be packed" in ended["r2"].detail
    assert faulty.runs_refused == 1  # failed once, then it is gone
    assert [f for r in run.results for f in r.failed] == [
        ("r2", "t", "ValueError: its sampling parameters cannot be packed")
    ]
    for name, ids in prompts.items():
        if name != "r2":
            assert run.outputs[name] == expected(ids, 12), name
    assert s.kv.registry.pool.num_referenced() == 0


def test_a_failed_swap_copy_recomputes_the_victim() -> None:
    executor = make_executor(pages=24)
    faulty = Faulty(executor)
    s = Scheduler(executor, SchedulerConfig(preemption="swap", swap_pages=100))
    s.set_tenant(TenantConfig("t"))
    prompts = {f"r{i}": prompt(40 + i, 14) for i in range(4)}
    for name, ids in prompts.items():
        s.submit(name, "t", ids, greedy(20))
    faulty.copies_fail = True
    run = Run(s)
    outputs = run.drain()
    assert faulty.failed_copies > 0, "the pool is not small enough to preempt"
    assert {c.kind for r in run.results for c in r.copy_failed} == {"swap_out"}
    assert all(request.host_pages is None for request in s.book.requests.values())
    assert s.swap_space.held == 0
    for name, ids in prompts.items():
        assert outputs[name] == expected(ids, 20), name
    stats = s.stats()
    assert stats.preempted_swap == 0 and stats.preempted_recompute >= faulty.failed_copies


def test_a_failed_offload_drops_the_blocks_and_nothing_else() -> None:
    executor = make_executor(pages=40)
    faulty = Faulty(executor)
    s = Scheduler(executor, SchedulerConfig(policy=SharingPolicy.PUBLIC, host_pages=80))
    s.set_tenant(TenantConfig("t"))
    shared = prompt(7, 32)
    run = Run(s)
    s.submit("first", "t", shared + [5], greedy(4))
    run.drain()
    faulty.copies_fail = True  # the flood's evictions cannot be offloaded
    for i in range(5):
        s.submit(f"flood{i}", "t", prompt(60 + i, 36), greedy(4))
    run.drain()
    assert faulty.failed_copies > 0
    assert {c.kind for r in run.results for c in r.copy_failed} == {"offload"}
    s.kv.registry.host.check_invariants()
    assert not s.kv.registry.host.blocks  # every block whose copy failed is gone
    faulty.copies_fail = False
    s.submit("again", "t", shared + [6], greedy(4))
    outputs = run.drain()
    assert outputs["again"] == expected(shared + [6], 4)  # recomputed, not read from nothing
    assert outputs["first"] == expected(shared + [5], 4)
