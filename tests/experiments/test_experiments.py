"""Each capacity experiment in its quick form: the files it writes, and the
invariants its figures must keep whatever the machine."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from kvd.cli import cli
from kvd.experiments import bytes as bytes_
from kvd.experiments import crossover, floor, fragmentation, isolation, prefix
from kvd.experiments.report import markdown, run_one, tagged_results
from kvd.experiments.results import ExperimentResult, load
from kvd.kv.capacity import eager_capacity
from kvd.kv.geometry import preset
from kvd.kv.layout import build_layout
from kvd.sched.costmodel import Rates
from kvd.units import parse_size

KIB = 1024


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("capacity")


def _run(name: str, out: Path) -> ExperimentResult:
    result = run_one(name, out, True, lambda _text: None)
    assert (out / f"{name}.json").is_file()
    assert result.plots and all((out / p).stat().st_size > 1000 for p in result.plots)
    assert load(out / f"{name}.json").answer == result.answer and result.answer
    assert all(len(row) == len(result.header) for row in result.rows)
    return result


def test_bytes_accounts_the_real_pool_and_the_seeds_figures(out: Path) -> None:
    result = _run("bytes", out)
    pools = msgspec.convert(result.data["pools"], list[bytes_.PoolBytes])
    engine, bf16, fp8, int8 = pools
    assert engine.source == "engine"
    # The same accounting without an engine gives the real engine's array.
    from kvd.engine.loader import random_model

    layout = build_layout(random_model(256, 32).config.kv_geometry("float32"), 16)
    predicted = bytes_.layout_pool(layout.geometry, parse_size("64MiB"))
    assert predicted.pool_bytes == engine.pool_bytes
    assert predicted.token_capacity == engine.token_capacity
    # The seed: 128 KiB/token on global layers, 320 KiB on sliding ones, at bf16.
    by_kind = {
        kind: sum(g.formula_bytes_per_token for g in bf16.groups if g.kind == kind)
        for kind in ("global", "sliding")
    }
    assert by_kind == {"global": 128 * KIB, "sliding": 320 * KIB}
    for pool in pools:
        assert pool.allocated_bytes_per_token >= pool.formula_bytes_per_token
        assert pool.overhead >= 0
    assert fp8.formula_bytes_per_token * 2 == bf16.formula_bytes_per_token
    # int8 stores an f32 scale per 256 values beside them (fp8 here: none).
    assert int8.formula_bytes_per_token == fp8.formula_bytes_per_token * (256 + 4) // 256


def test_floor_lazy_windows_fit_at_least_the_eager_count_at_every_length(out: Path) -> None:
    result = _run("floor", out)
    curves = msgspec.convert(result.data["curves"], list[floor.FloorCurve])
    seed = preset("gemma4-12b")
    assert eager_capacity(seed, parse_size("3.8GiB")).max_sequences == 12  # the seed's ceiling
    for curve in curves:
        points = curve.points
        assert [p.length for p in points] == sorted(p.length for p in points)
        assert all(p.kvd >= p.eager for p in points)
        assert all(a.kvd >= b.kvd for a, b in zip(points, points[1:], strict=False))
        assert points[0].kvd > points[0].eager  # a short sequence never pays the floor
    twelve_b = curves[0]
    assert twelve_b.eager_floor_bytes == 320 * 2**20
    assert twelve_b.points[0].eager == floor.eager_sequences(seed, parse_size("3.8GiB"), 64)


def test_the_fragmentation_sampler_counts_the_pages_the_pool_has_referenced() -> None:
    """Every page a live sequence holds is referenced in the pool, and with no
    public prefix pinned (isolated) nothing else is."""
    from kvd.experiments.replay import ReplaySettings, replay
    from kvd.experiments.workload import default_shape, generate
    from kvd.kv.scope import SharingPolicy

    sessions = generate(default_shape(sessions=6, duration_s=10, scale=0.1))
    settings = ReplaySettings(
        preset("gemma4-12b"), parse_size("1GiB"), policy=SharingPolicy.ISOLATED
    )
    replayed = replay(sessions, settings)
    busy = [s for s in replayed.samples if s.sequences]
    assert busy
    for sample in busy:
        assert 0 < sample.live_bytes <= sample.allocated_bytes == sample.referenced_bytes


def test_fragmentation_stays_within_the_pool_and_beats_contiguous(out: Path) -> None:
    result = _run("fragmentation", out)
    blocks = msgspec.convert(result.data["blocks"], list[fragmentation.BlockFigures])
    assert [b.block_size for b in blocks] == [8, 16, 32, 64]
    for b in blocks:
        assert b.samples > 0
        assert all(0 < u <= 1 for _, u in b.series)
        assert 0 < b.paged_worst <= b.paged_utilisation <= 1
        # A partly filled last block, and a sliding group's first block partly
        # out of the window: never more than two blocks per sequence per group.
        assert 0 <= b.waste_blocks_per_sequence_group <= 2
        assert b.context_utilisation < b.contiguous_utilisation < b.paged_utilisation


def test_prefix_hits_stay_under_the_unbounded_cache_and_follow_the_policy(out: Path) -> None:
    result = _run("prefix", out)
    runs = msgspec.convert(result.data["runs"], list[prefix.PolicyFigures])
    assert {(r.where, r.policy, r.salts) for r in runs} == {
        (where, policy, salts) for where in ("daemon", "kv-core") for policy, salts in prefix.RUNS
    }
    for r in runs:
        assert r.failed == 0 and r.requests > 0
        assert 0 <= r.hit_rate <= 1 and 0 <= r.ideal_hit_rate <= 1
        assert r.ttft_p50_s and all(v <= r.ttft_p99_s[t] for t, v in r.ttft_p50_s.items())
        if r.where == "kv-core":  # exact tokens: nothing can beat the unbounded cache
            assert r.cached_tokens <= r.ideal_hit_rate * r.prompt_tokens + 1e-6
    # Wider scopes can only find more (the KV-core replay's prompts are the
    # same under every policy; the daemon's depend on its replies).
    ideal = {
        prefix._label(r.policy, r.salts): r.ideal_hit_rate for r in runs if r.where == "kv-core"
    }
    assert ideal["isolated"] <= ideal["public"] <= ideal["shared"]
    assert ideal["public+salts"] <= ideal["public"]


def test_crossover_restores_swapped_pages_and_reports_the_schedulers_pick(out: Path) -> None:
    result = _run("crossover", out)
    victims = msgspec.convert(result.data["victims"], list[crossover.VictimTimes])
    assert [v.tokens for v in victims] == [16, 32, 64, 128, 256]
    assert all(v.pages_restored for v in victims)
    assert all(v.recompute_s > 0 and v.swap_out_s > 0 and v.swap_in_s > 0 for v in victims)
    # The reported crossover is where the scheduler's own comparison flips, on
    # the pages the KV core really swapped.
    rates = msgspec.convert(result.data["rates"], Rates)
    crossover_at = result.data["model_crossover_tokens"]
    for v in victims:
        assert rates.pages_for(v.tokens) == v.pages
        swap_cheaper = rates.swap_s(v.pages) < rates.recompute_s(v.tokens)
        assert swap_cheaper == (crossover_at is not None and v.tokens >= crossover_at)
    measured = result.data["measured_crossover_tokens"]
    if measured is not None:
        assert all(v.swap_s < v.recompute_s for v in victims if v.tokens >= measured)


def test_isolation_runs_every_budget_mode_against_the_idle_run(out: Path) -> None:
    result = _run("isolation", out)
    runs = result.data["runs"]
    assert [r["mode"] for r in runs] == list(isolation.MODES)
    for r in runs:
        assert r["flood_completed"] == r["flood_requests"]
        assert len(r["ttft_flood_s"]) == r["interactive_requests"] == len(r["queue_steps"])
        assert r["queue_steps_max"] >= 0
        assert all(t > 0 for t in r["ttft_idle_s"] + r["ttft_flood_s"])


def test_the_report_holds_every_answer_and_plot(out: Path) -> None:
    results = [load(path) for path in sorted(out.glob("*.json"))]
    assert results, "the experiments above write their JSON first"
    text = markdown(results, "kvd experiment report --quick")
    for r in results:
        assert r.answer in text
        for plot in r.plots:
            assert f"]({plot})" in text and (out / plot).is_file()


def test_cli_runs_an_experiment_and_refuses_an_unknown_one(tmp_path: Path) -> None:
    runner = CliRunner()
    done = runner.invoke(cli, ["experiment", "floor", "--quick", "--out", str(tmp_path)])
    assert done.exit_code == 0, done.output
    assert "answer: lazily" in done.output and (tmp_path / "floor.png").is_file()
    refused = runner.invoke(cli, ["experiment", "nonsense"])
    assert refused.exit_code == 2 and "nonsense" in refused.output
    bad_tag = runner.invoke(cli, ["experiment", "floor", "--quick", "--tag", "../x"])
    assert bad_tag.exit_code == 2 and "--tag" in bad_tag.output


def test_a_tagged_run_from_another_device_joins_the_report(tmp_path: Path) -> None:
    runner = CliRunner()
    done = runner.invoke(
        cli, ["experiment", "floor", "--quick", "--out", str(tmp_path), "--tag", "tpu_v5e"]
    )
    assert done.exit_code == 0, done.output
    assert (tmp_path / "floor-tpu_v5e.json").is_file()
    assert (tmp_path / "floor-tpu_v5e.png").is_file() and not (tmp_path / "floor.png").exists()
    (found,) = tagged_results(tmp_path)
    assert found.name == "floor-tpu_v5e" and found.plots == ["floor-tpu_v5e.png"]
    text = markdown([found], "test")
    assert "run tagged tpu_v5e" in text and "](floor-tpu_v5e.png)" in text
    # The report rebuilt from the JSON: this machine's result and the tagged one.
    alone = runner.invoke(cli, ["experiment", "report", "--from-json", "--out", str(tmp_path)])
    assert alone.exit_code == 2 and "no experiment results" in alone.output
    assert (
        runner.invoke(cli, ["experiment", "floor", "--quick", "--out", str(tmp_path)]).exit_code
        == 0
    )
    rebuilt = runner.invoke(cli, ["experiment", "report", "--from-json", "--out", str(tmp_path)])
    assert rebuilt.exit_code == 0, rebuilt.output
    report = (tmp_path / "README.md").read_text()
    assert "](floor.png)" in report and "](floor-tpu_v5e.png)" in report
