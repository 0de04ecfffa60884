"""Configuration files, `kvd check-config`, and stop-string streaming."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from kvd.cli import cli
from kvd.server.config import ConfigError, load_config, pages_of

REPO = Path(__file__).resolve().parents[2]
KEY = "d93d17449c095335a72f8000357bd400fb42d2368421d771778fac8412bfae65"
TENANT = f'[[tenants]]\nname = "alice"\napi_key_sha256 = "{KEY}"\n'


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvd.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", ["kvd.toml", "kvd.dev.toml"])
def test_shipped_configs_are_valid(name: str) -> None:
    config = load_config(REPO / "etc" / name)
    assert config.tenants


def test_dev_config_matches_the_readme() -> None:
    config = load_config(REPO / "etc" / "kvd.dev.toml")
    assert config.server.listen == "127.0.0.1:8000"
    assert config.model.source == "gemma3-270m"
    assert [t.name for t in config.tenants] == ["alice", "bob"]
    assert config.path(config.server.admin_socket).parent == REPO / "run"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[server]\nlisten = 8000\n" + TENANT, "server.listen: Expected `str`, got `int`"),
        (
            "[server]\nlisten = 'localhost'\n" + TENANT,
            "server.listen: 'localhost' is not HOST:PORT",
        ),
        ("[server]\nlisen = '127.0.0.1:1'\n" + TENANT, "unknown field `lisen`"),
        ("[pool]\nsize = '3 parsecs'\n" + TENANT, "pool.size"),
        ("[budget]\nmode = 'anarchy'\n" + TENANT, "budget.mode"),
        ("[sharing]\npolicy = 'everyone'\n" + TENANT, "sharing.policy"),
        ("[model]\ndtype = 'int4'\n" + TENANT, "model.dtype"),
        ("[model]\nquantization = 'int4'\n" + TENANT, "model.quantization: 'int4' is not"),
        ("[pool]\nhost_size = 'lots'\n" + TENANT, "pool.host_size"),
        (TENANT + "host_quota = 'lots'\n", "tenants.alice.host_quota"),
        ("[model]\nkv_dtype = 'fp8'\n" + TENANT, "model.kv_dtype: 'fp8' is not one of"),
        ("[model]\nattention = 'cuda'\n" + TENANT, "model.attention: 'cuda' is not one of"),
        ("[model]\nmatmul = 'mkl'\n" + TENANT, "model.matmul: 'mkl' is not one of auto"),
        ("[model]\nkv_dtype = 'int3'\n" + TENANT, "model.kv_dtype: 'int3'"),
        ("[model]\nmax_num_seqs = 0\n" + TENANT, "model.max_num_seqs: must be > 0"),
        ("", "at least one tenant"),
        (TENANT + TENANT, "tenants.alice: the tenant is defined twice"),
        (TENANT.replace(KEY, "kvd-dev-alice"), "not a lowercase hex SHA-256"),
        (TENANT + "reservation = '120%'\n", "between 0% and 100%"),
        (TENANT + "reservation = 'lots'\n", "tenants.alice.reservation"),
        (TENANT + "tier = 'gold'\n", "unknown tier 'gold'"),
        (TENANT + "weight = -1.0\n", "tenants.alice.weight: must be > 0"),
        (TENANT + "weight = nan\n", "tenants.alice.weight: must be a finite number"),
        (TENANT + "tokens_per_minute = inf\n", "tokens_per_minute: must be a finite number"),
        ("[server]\ndrain_timeout = inf\n" + TENANT, "server.drain_timeout: must be a finite"),
        ("[[prefixes]]\nname = 'p'\n" + TENANT, "exactly one of text, token_file, chat_system"),
        ("[server\n" + TENANT, "not valid TOML"),
    ],
)
def test_errors_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        load_config(write(tmp_path, text))
    assert message in str(info.value), str(info.value)
    assert str(tmp_path / "kvd.toml") in str(info.value)


def test_budgets_in_pages() -> None:
    assert pages_of("r", "25%", 4096, 1000) == 250
    assert pages_of("r", "1MiB", 4096, 1000) == 256
    assert pages_of("r", "0", 4096, 1000) == 0


def run_kvd(*args: str) -> Result:
    """The kvd command line in this process (its parsing and messages are the
    subject, not a process: these commands never start a daemon)."""
    return CliRunner().invoke(cli, list(args), prog_name="kvd")


@pytest.mark.parametrize("name", ["kvd.toml", "kvd.dev.toml"])
def test_every_example_config_checks(name: str) -> None:
    ok = run_kvd("check-config", str(REPO / "etc" / name))
    assert ok.exit_code == 0 and ": ok (model" in ok.stdout, ok.stderr


def test_check_config_cli(tmp_path: Path) -> None:
    bad = run_kvd("check-config", str(write(tmp_path, "[server]\nnope = 1\n" + TENANT)))
    assert bad.exit_code == 2
    assert bad.stderr.startswith("kvd: error: ") and "nope" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    missing = run_kvd("check-config", str(tmp_path / "absent.toml"))
    assert missing.exit_code == 2 and "no such file" in missing.stderr
    serve = run_kvd("serve", "--config", str(tmp_path / "absent.toml"))
    assert serve.exit_code == 2 and "no such file" in serve.stderr
    listen = run_kvd("serve", "--config", str(REPO / "etc" / "kvd.dev.toml"), "--listen", "x")
    assert listen.exit_code == 2 and "HOST:PORT" in listen.stderr
    needs = run_kvd("serve")
    assert needs.exit_code == 2 and "--config" in needs.stderr


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    import os

    from kvd.engine.loader import random_model_with_tokenizer

    old = os.environ.get("KVD_CACHE_DIR")
    os.environ["KVD_CACHE_DIR"] = str(tmp_path_factory.mktemp("tok-cache"))
    try:
        return random_model_with_tokenizer().tokenizer
    finally:
        if old is None:
            os.environ.pop("KVD_CACHE_DIR", None)
        else:
            os.environ["KVD_CACHE_DIR"] = old


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("Hello world, hello moon", ("moon",), "Hello world, hello "),
        ("Hello world, hello moon", ("o w", "moon"), "Hell"),
        ("Hello world", ("xyz",), "Hello world"),
        ("naïve café 東京 🙂 done", ("🙂",), "naïve café 東京 "),
        ("abc\n\nUser:", ("\n\nUser:",), "abc"),
    ],
)
def test_text_stream_stops(tokenizer, text: str, stops: tuple[str, ...], expected: str) -> None:  # type: ignore[no-untyped-def]
    from kvd.server.textstream import TextStream

    ids = tokenizer.encode(text, add_bos=False)
    stream = TextStream(tokenizer, stops)
    out = ""
    for token in ids:
        out += stream.push(token)
        if stream.stopped:
            break
        # Released text is never a stop string's start that could still complete.
        assert not any(s in out for s in stops)
    out += stream.flush()
    assert out == expected
    assert stream.stopped == (expected != text)
