"""Bad input to ``python -m mcp_context.convert``: refused with one line on stderr and exit status 2.

Each class of bad input the docs name is built small in ``tmp_path``: malformed safetensors (the
byte ranges the ``safetensors`` library refuses: negative, overlapping, gapped or out-of-file
offsets, trailing bytes, wrong sizes, unknown dtypes, broken headers), missing files, bad
``config.json`` / index / ``metadata.json`` files, damaged Megatron files, unsupported models and
bad arguments. Nothing is written for a refused input, and no traceback reaches the user.
"""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from mcp_context.convert.__main__ import main
from mcp_context.convert.converter import hf_to_mcore
from mcp_context.convert.hf_io import HFCheckpointReader
from mcp_context.convert.random_checkpoint import write_random_hf_checkpoint
from tests.convert_fixtures import cli_error

pytest.importorskip("safetensors", reason="the converter reads safetensors through the safetensors library")

REPO = Path(__file__).resolve().parents[1]
TINY = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny fp32 HF checkpoint (one file) and its megatron-core conversion."""
    root = tmp_path_factory.mktemp("tiny")
    write_random_hf_checkpoint(root / "hf", TINY, torch.float32)
    hf_to_mcore(root / "hf", root / "mcore", progress=False)
    return root / "hf", root / "mcore"


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for file in src.rglob("*"):
        if file.is_file():
            (dst / file.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            (dst / file.relative_to(src)).write_bytes(file.read_bytes())
    return dst



def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _edit_header(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        header, data = _split(path)
        edit(header)
        path.write_bytes(_join(header, data))
    return apply


def _negative_offset(header: dict) -> None:
    begin, end = header["model.norm.weight"]["data_offsets"]
    header["model.norm.weight"]["data_offsets"] = [begin - end - 16, -16]  # the header's last bytes


def _overlap(header: dict) -> None:  # layer 1's norm would read layer 0's bytes
    header["model.layers.1.input_layernorm.weight"]["data_offsets"] = \
        header["model.layers.0.input_layernorm.weight"]["data_offsets"]


def _gap(header: dict) -> None:  # the last tensor starts 4 bytes late and ends past the data
    name = max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])
    header[name]["data_offsets"] = [o + 4 for o in header[name]["data_offsets"]]


def _wrong_shape(header: dict) -> None:
    header["model.norm.weight"]["shape"] = [17]


def _bad_dtype(header: dict) -> None:
    header["model.norm.weight"]["dtype"] = "F33"


def _no_dtype(header: dict) -> None:
    del header["model.norm.weight"]["dtype"]


def _header_len_past_end(path: Path) -> None:
    path.write_bytes(struct.pack("<Q", 10**9) + path.read_bytes()[8:])


def _bad_json(path: Path) -> None:
    header, data = _split(path)
    text = json.dumps(header).encode()[:-1] + b","  # an object that never closes
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


MALFORMED = {
    "negative_offsets": _edit_header(_negative_offset),
    "overlapping_offsets": _edit_header(_overlap),
    "gap_and_offsets_past_the_end": _edit_header(_gap),
    "trailing_bytes": lambda p: p.write_bytes(p.read_bytes() + b"\0" * 8),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:-4]),
    "shape_disagrees_with_byte_range": _edit_header(_wrong_shape),
    "unknown_dtype": _edit_header(_bad_dtype),
    "entry_without_dtype": _edit_header(_no_dtype),
    "header_length_past_the_end": _header_len_past_end,
    "header_not_json": _bad_json,
    "shorter_than_8_bytes": lambda p: p.write_bytes(b"\1\2\3"),
}


@pytest.mark.parametrize("damage", list(MALFORMED))
def test_malformed_safetensors_are_refused_naming_the_file(tiny, tmp_path, capsys, damage):
    hf = _copy(tiny[0], tmp_path / "hf")
    MALFORMED[damage](hf / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors"):
        HFCheckpointReader(hf)
    err = cli_error(capsys, "hf-to-mcore", "--hf", str(hf), "--mcore", str(tmp_path / "out"), "--no-progress")
    assert str(hf / "model.safetensors") in err
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


def test_reader_gives_each_tensor_its_own_bytes(tiny):
    """The reference is the safetensors library's own loader."""
    from safetensors.torch import load_file

    reader = HFCheckpointReader(tiny[0])
    theirs = load_file(tiny[0] / "model.safetensors")
    assert sorted(reader.names()) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(reader.read(name), tensor), name


def test_malformed_offsets_fail_in_a_real_process_with_one_line_and_no_traceback(tiny, tmp_path):
    hf = _copy(tiny[0], tmp_path / "hf")
    MALFORMED["negative_offsets"](hf / "model.safetensors")
    proc = subprocess.run([sys.executable, "-m", "mcp_context.convert", "hf-to-mcore", "--hf", str(hf),
                           "--mcore", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr and "invalid" in proc.stderr


# ---- missing and malformed side files -------------------------------------------------------------

def _sharded(tiny: Path, dst: Path) -> Path:
    """``tiny`` re-written as two shards with an index."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    tensors = load_file(tiny / "model.safetensors")
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for file, part in files.items():
        save_file({n: tensors[n] for n in part}, str(dst / file))
    weight_map = {n: f for f, part in files.items() for n in part}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (dst / "config.json").write_bytes((tiny / "config.json").read_bytes())
    return dst


def _set_index(hf: Path, edit: Callable[[dict], None]) -> None:
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    edit(index)
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))


INDEX_DAMAGE = {
    "no_weight_map": (lambda i: i.pop("weight_map"), "weight_map"),
    "shard_missing": (lambda i: i["weight_map"].update({k: "model-00009-of-00009.safetensors"
                                                        for k in list(i["weight_map"])[:1]}),
                      "model-00009-of-00009.safetensors"),
    "shard_outside_the_directory": (lambda i: i["weight_map"].update({k: "../model.safetensors"
                                                                      for k in list(i["weight_map"])[:1]}),
                                    "'../model.safetensors'"),
    "tensor_not_in_the_index": (lambda i: i["weight_map"].pop("model.norm.weight"), "model.norm.weight"),
    "entry_no_shard_holds": (lambda i: i["weight_map"].update({"model.extra.weight": i["weight_map"]["model.norm.weight"]}),
                             "model.extra.weight"),
}


def test_sharded_copy_converts(tiny, tmp_path, capsys):
    hf = _sharded(tiny[0], tmp_path / "hf")
    assert main(["hf-to-mcore", "--hf", str(hf), "--mcore", str(tmp_path / "out"), "--no-progress"]) == 0


@pytest.mark.parametrize("damage", list(INDEX_DAMAGE))
def test_bad_index_is_refused_naming_the_entry(tiny, tmp_path, capsys, damage):
    edit, needle = INDEX_DAMAGE[damage]
    hf = _sharded(tiny[0], tmp_path / "hf")
    _set_index(hf, edit)
    err = cli_error(capsys, "hf-to-mcore", "--hf", str(hf), "--mcore", str(tmp_path / "out"), "--no-progress")
    assert needle in err
    assert not (tmp_path / "out").exists()


BAD_CONFIGS = {
    "not_json": ("{\"model_type\": \"llama\",", "not valid JSON"),
    "a_list": ("[1, 2]", "JSON list, not an object"),
    "not_utf8": (b"\xff\xfe{}", "not UTF-8"),
    "refused_by_transformers": (json.dumps({**TINY, "initializer_range": "big"}),
                                "config.json is refused by transformers"),
    "text_for_a_number": (json.dumps({**TINY, "hidden_size": "wide"}), "hidden_size='wide'"),
    "null_for_a_number": (json.dumps({**TINY, "num_hidden_layers": None}), "num_hidden_layers=None"),
    "zero_heads": (json.dumps({**TINY, "num_attention_heads": 0}), "num_attention_heads=0"),
    "zero_kv_heads": (json.dumps({**TINY, "num_key_value_heads": 0}), "num_key_value_heads=0"),
    "negative_vocab": (json.dumps({**TINY, "vocab_size": -1}), "vocab_size=-1"),
    "fractional_layers": (json.dumps({**TINY, "num_hidden_layers": 1.5}), "num_hidden_layers=1.5"),
    "unsupported_model_type": (json.dumps({**TINY, "model_type": "gemma"}), "model_type='gemma'"),
    "bad_eps": (json.dumps({**TINY, "rms_norm_eps": "small"}), "rms_norm_eps='small'"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_json_is_refused_naming_the_field(tiny, tmp_path, capsys, case):
    text, needle = BAD_CONFIGS[case]
    hf = _copy(tiny[0], tmp_path / "hf")
    (hf / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    err = cli_error(capsys, "hf-to-mcore", "--hf", str(hf), "--mcore", str(tmp_path / "out"), "--no-progress")
    assert needle in err
    (tmp_path / "cfg.json").write_bytes((hf / "config.json").read_bytes())  # the same file as --hf-config
    err = cli_error(capsys, "mcore-to-hf", "--mcore", str(tiny[1]), "--hf", str(tmp_path / "back"),
               "--hf-config", str(tmp_path / "cfg.json"), "--no-progress")
    assert needle in err
    err = cli_error(capsys, "make-random", "--config", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "rnd"))
    assert needle in err
    assert not any((tmp_path / d).exists() for d in ("out", "back", "rnd"))


def test_missing_files_are_named(tiny, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert "config.json not found" in cli_error(capsys, "hf-to-mcore", "--hf", str(tmp_path / "nowhere"), "--mcore", out)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(TINY))
    assert "neither model.safetensors.index.json nor model.safetensors" in \
        cli_error(capsys, "hf-to-mcore", "--hf", str(tmp_path / "empty"), "--mcore", out)
    assert "metadata.json not found" in cli_error(capsys, "mcore-to-hf", "--mcore", str(tmp_path / "nowhere"), "--hf", out)
    assert str(tmp_path / "no.json") in cli_error(capsys, "mcore-to-hf", "--mcore", str(tiny[1]), "--hf", out,
                                             "--hf-config", str(tmp_path / "no.json"))
    assert str(tmp_path / "no.json") in cli_error(capsys, "make-random", "--config", str(tmp_path / "no.json"),
                                             "--out", out)
    mcore = _copy(tiny[1], tmp_path / "mcore")
    (mcore / ".metadata").unlink()
    assert ".metadata" in cli_error(capsys, "mcore-to-hf", "--mcore", str(mcore), "--hf", out)
    mcore = _copy(tiny[1], tmp_path / "mcore2")
    next(mcore.glob("*.distcp")).unlink()
    assert ".distcp" in cli_error(capsys, "mcore-to-hf", "--mcore", str(mcore), "--hf", out, "--no-progress")
    assert "already exists" in cli_error(capsys, "hf-to-mcore", "--hf", str(tiny[0]), "--mcore", str(tiny[1]))
    assert not (tmp_path / "out").exists()


MCORE_DAMAGE = {
    "metadata_json_not_json": (lambda d: (d / "metadata.json").write_text("{"), "metadata.json is not valid JSON"),
    "metadata_json_a_list": (lambda d: (d / "metadata.json").write_text("[]"), "metadata.json holds a JSON list"),
    "other_backend": (lambda d: (d / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"})),
                      "sharded_backend='zarr'"),
    "dcp_metadata_truncated": (lambda d: (d / ".metadata").write_bytes((d / ".metadata").read_bytes()[:40]),
                               ".metadata"),
    "dcp_metadata_not_metadata": (lambda d: (d / ".metadata").write_bytes(b"\x80\x04K\x07."), ".metadata"),
    "distcp_truncated": (lambda d: [p.write_bytes(p.read_bytes()[:10]) for p in d.glob("*.distcp")], ".distcp"),
    "architecture_record_not_json": (lambda d: (d / "mcp_context" / "architecture.json").write_text("{"),
                                     "architecture.json is not valid JSON"),
    "architecture_record_unknown_field": (
        lambda d: (d / "mcp_context" / "architecture.json").write_text(json.dumps({"colour": "red"})), "colour"),
}


@pytest.mark.parametrize("damage", list(MCORE_DAMAGE))
def test_damaged_megatron_checkpoint_is_refused_naming_the_file(tiny, tmp_path, capsys, damage):
    edit, needle = MCORE_DAMAGE[damage]
    mcore = _copy(tiny[1], tmp_path / "mcore")
    edit(mcore)
    err = cli_error(capsys, "mcore-to-hf", "--mcore", str(mcore), "--hf", str(tmp_path / "out"), "--no-progress")
    assert needle in err
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


BAD_ARGS = {
    "no_command": ([], "command"),
    "unknown_command": (["convert"], "'convert'"),
    "missing_option": (["hf-to-mcore", "--hf", "x"], "--mcore"),
    "unknown_option": (["hf-to-mcore", "--hf", "x", "--mcore", "y", "--fast"], "--fast"),
    "bad_size": (["mcore-to-hf", "--mcore", "x", "--hf", "y", "--max-shard-size", "big"], "'big'"),
    "zero_size": (["mcore-to-hf", "--mcore", "x", "--hf", "y", "--max-shard-size", "0"], "'0'"),
    "negative_tolerance": (["verify", "--hf", "x", "--mcore", "y", "--tolerance", "-1"], "--tolerance"),
    "nan_tolerance": (["verify", "--hf", "x", "--mcore", "y", "--tolerance", "nan"], "--tolerance"),
    "bad_dtype": (["make-random", "--out", "x", "--config", "y", "--dtype", "int8"], "'int8'"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bad_arguments_are_one_line_and_exit_2(capsys, case):
    argv, needle = BAD_ARGS[case]
    assert needle in cli_error(capsys, *argv)


def test_a_valid_file_with_a_dtype_the_converter_does_not_handle_is_refused_naming_the_tensor(tmp_path, capsys):
    from safetensors.torch import save_file

    (tmp_path / "hf").mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(32, 16, dtype=torch.uint16)},
              str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "hf" / "config.json").write_text(json.dumps(TINY))
    err = cli_error(capsys, "hf-to-mcore", "--hf", str(tmp_path / "hf"), "--mcore", str(tmp_path / "out"))
    assert "'model.embed_tokens.weight'" in err and "'U16'" in err
