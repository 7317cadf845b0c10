"""transformers versions compute some models other than their config.json says (``hf_quirks.IGNORED_FIELDS``):
transformers 5.17's ``GptOssExperts`` hard-codes ``limit = 7.0`` and ``alpha = 1.702``, ignoring ``swiglu_limit`` /
``swiglu_alpha``; 5.24 reads them. The probe finds that from the installed transformers itself, and ``verify``
names the version and the field instead of "the models compute differently". Here 5.17 is reproduced by
patching the installed ``GptOssExperts`` the way 5.17 writes it (no second transformers installs on this machine).
"""
from __future__ import annotations

import json

import pytest

from mcp_context.convert.hf_quirks import IGNORED_FIELDS, ignored_fields
from tests._dist import run_distributed

transformers = pytest.importorskip("transformers", reason="the probe reads transformers' own modules")
pytest_plugins = ["tests.convert_fixtures"]


def _hard_code_5_17_constants(monkeypatch) -> None:
    """Make the installed GptOssExperts compute as transformers 5.17's does."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    init = modeling_gpt_oss.GptOssExperts.__init__

    def init_5_17(self, config):
        init(self, config)
        self.limit, self.alpha = 7.0, 1.702

    monkeypatch.setattr(modeling_gpt_oss.GptOssExperts, "__init__", init_5_17)


def test_the_installed_transformers_is_probed_not_assumed_from_its_version(monkeypatch):
    config = {"model_type": "gpt_oss", "swiglu_limit": 1.5, "swiglu_alpha": 1.702}
    honoured = ignored_fields(config)  # whatever this transformers does, the probe reports it
    _hard_code_5_17_constants(monkeypatch)
    found = ignored_fields(config)
    assert len(found) == 1 and "GptOssExperts computes with limit=7.0 whatever config.json's swiglu_limit=1.5 " \
                               "says (transformers 5.17 hard-codes 7.0; 5.24 reads the field)" in found[0]
    assert ignored_fields({**config, "swiglu_limit": 7.0}) == []  # the hard-coded value is the file's: no note
    assert honoured in ([], found)
    assert {row.model_type for row in IGNORED_FIELDS} == {"gpt_oss"}


def test_verify_names_the_transformers_version_and_field_not_a_compute_difference(converted_families):
    hf_dir, mcore_dir, _, _ = converted_families["gpt_oss"]
    assert json.loads((hf_dir / "config.json").read_text())["swiglu_limit"] == 1.5  # the clamp the tokens reach
    status, err = run_distributed(1, _case_verify_as_5_17, str(hf_dir), str(mcore_dir))[0]
    assert status == 1, err
    assert "every tensor is identical on both sides, so the models compute differently; transformers " in err
    assert "GptOssExperts computes with limit=7.0 whatever config.json's swiglu_limit=1.5 says" in err, err


def _case_verify_as_5_17(rank, world_size, hf_dir, mcore_dir):
    from tests.test_convert_families import _case_verify

    with pytest.MonkeyPatch.context() as monkeypatch:
        _hard_code_5_17_constants(monkeypatch)
        return _case_verify(rank, world_size, hf_dir, mcore_dir)


def test_hf_to_mcore_notes_a_field_the_installed_transformers_ignores(converted_families, monkeypatch, capsys,
                                                                      tmp_path):
    from mcp_context.convert.__main__ import main

    _hard_code_5_17_constants(monkeypatch)
    hf_dir = converted_families["gpt_oss"][0]
    assert main(["hf-to-mcore", "--hf", str(hf_dir), "--mcore", str(tmp_path / "mcore"), "--no-progress"]) == 0
    assert "notice: converted as config.json says, but transformers " in capsys.readouterr().err
