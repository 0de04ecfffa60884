"""Checkpoint loading: Hugging Face directories and GGUF files, and every bad
input turned into an error that names the problem."""

from __future__ import annotations

import json
from copy import deepcopy
from pathlib import Path

import numpy as np
import pytest

from kvd.engine.gguf import GGUFError, GGUFFile
from kvd.engine.weights import WeightsError, load_hf_directory, params_from_hf
from tests.engine.conftest import TinyModel, torch

gguf = pytest.importorskip("gguf")


def _save(model: TinyModel, path: Path, **kwargs: object) -> Path:
    model.hf.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def _same(a: dict, b: dict) -> None:  # type: ignore[type-arg]
    np.testing.assert_array_equal(a["embed"], b["embed"])
    for left, right in zip(a["layers"], b["layers"], strict=True):
        for name in left:
            np.testing.assert_array_equal(left[name], right[name])


def test_sharded_safetensors_directory(tiny3: TinyModel, tmp_path: Path) -> None:
    path = _save(tiny3, tmp_path / "ckpt", max_shard_size="40KB")
    assert len(list(path.glob("*.safetensors"))) > 1
    cfg, params = load_hf_directory(path, np.float32)
    assert cfg.layer_kinds == tiny3.config.layer_kinds
    assert cfg.rope_global_scale == 8.0 and cfg.sliding_window == 8
    _same(params, tiny3.params)


def test_bfloat16_safetensors_are_widened(tiny3: TinyModel, tmp_path: Path) -> None:
    path = tmp_path / "bf16"
    copy = deepcopy(tiny3.hf).to(torch.bfloat16)  # the shared oracle stays f32
    copy.save_pretrained(path, safe_serialization=True)
    _, params = load_hf_directory(path, np.float32)
    state = {k: v.float().numpy() for k, v in copy.state_dict().items()}
    _same(params, params_from_hf(tiny3.config, state, np.float32))


def test_wrong_tensor_shape_is_named(tiny3: TinyModel, tmp_path: Path) -> None:
    path = _save(tiny3, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 100
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match=r"layers\.0\.gate has shape \(64, 96\).*\(64, 100\)"):
        load_hf_directory(path, np.float32)


def test_truncated_and_missing_safetensors(tiny3: TinyModel, tmp_path: Path) -> None:
    path = _save(tiny3, tmp_path / "ckpt")
    (shard,) = path.glob("*.safetensors")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="truncated"):
        load_hf_directory(path, np.float32)
    shard.write_bytes(b"\x00" * 7)
    with pytest.raises(WeightsError, match="not a safetensors file"):
        load_hf_directory(path, np.float32)
    shard.unlink()
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        load_hf_directory(path, np.float32)
    (path / "config.json").unlink()
    with pytest.raises(WeightsError, match="no config.json"):
        load_hf_directory(path, np.float32)


def _write_gguf(path: Path, quant: int, data: np.ndarray, shape: tuple[int, ...]) -> None:
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(1)
    writer.add_tensor("blk.0.w", data, raw_shape=shape, raw_dtype=gguf.GGMLQuantizationType(quant))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_reader_and_its_errors(tmp_path: Path) -> None:
    good = tmp_path / "good.gguf"
    values = np.arange(64, dtype=np.float32).reshape(2, 32)
    _write_gguf(good, 0, values, (2, 32))
    with GGUFFile(good) as file:
        assert file.metadata["general.architecture"] == "gemma3"
        np.testing.assert_array_equal(file.load("blk.0.w"), values)
        with pytest.raises(GGUFError, match="no tensor named 'nope'"):
            file.load("nope")
    q4_0 = tmp_path / "q4_0.gguf"
    _write_gguf(q4_0, 2, np.zeros(18 * 2, np.uint8), (2, 18))  # two Q4_0 blocks
    with pytest.raises(GGUFError, match="quantisation type 2, which kvd cannot dequantise"):
        GGUFFile(q4_0)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(GGUFError, match="truncated"):
        GGUFFile(truncated)
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 zip, not gguf")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(not_gguf)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError, match="empty file"):
        GGUFFile(empty)
    with pytest.raises(GGUFError, match="no such file"):
        GGUFFile(tmp_path / "missing.gguf")
