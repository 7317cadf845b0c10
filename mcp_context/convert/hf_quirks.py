"""Fields of ``config.json`` that the installed transformers does not compute with, found by probing it.

Owns the table of known per-version differences between a config field and what a transformers module
really uses (``IGNORED_FIELDS``), and the probe: the module is built from the config on the ``meta``
device (no memory) and the attribute it computes with is read back. The converter maps the field as
config.json says (megatron-core computes with it), so where transformers ignores it the two sides'
logits differ for transformers' reason, not the conversion's; ``verify`` and ``hf-to-mcore`` say so,
naming the version and the field. It converts and compares nothing itself.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class IgnoredField:
    """One known difference: ``module``'s ``attribute`` is what ``model_type``'s ``field`` should set."""
    model_type: str
    field: str
    module: str
    attribute: str
    seen: str


IGNORED_FIELDS = (
    IgnoredField("gpt_oss", "swiglu_limit", "transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts", "limit",
                 "transformers 5.17 hard-codes 7.0; 5.24 reads the field"),
    IgnoredField("gpt_oss", "swiglu_alpha", "transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts", "alpha",
                 "transformers 5.17 hard-codes 1.702; 5.24 reads the field"),
)
"""Seen on a GPU machine with transformers 5.17 (issue 27); each row is probed, not assumed from a version."""


def ignored_fields(config: dict[str, Any]) -> list[str]:
    """One sentence per field of ``config`` (a ``config.json`` dict) that the installed transformers computes
    other than the file says; empty when it honours them all (or cannot build the module to look)."""
    import importlib

    import torch
    import transformers
    from transformers import AutoConfig

    found = []
    for row in IGNORED_FIELDS:
        if config.get("model_type") != row.model_type:
            continue
        module_path, cls_name = row.module.rsplit(".", 1)
        try:  # sizes shrunk: the attribute does not depend on them, and meta tensors take no memory
            small = AutoConfig.for_model(**{**copy.deepcopy(config), "hidden_size": 8, "intermediate_size": 8,
                                            "num_local_experts": 2, "num_experts_per_tok": 1})
            wanted = getattr(small, row.field)
            with torch.device("meta"):
                used = getattr(getattr(importlib.import_module(module_path), cls_name)(small), row.attribute)
        except Exception:  # another transformers layout: nothing known to say
            continue
        if used != wanted:
            found.append(f"transformers {transformers.__version__}'s {cls_name} computes with {row.attribute}={used} "
                         f"whatever config.json's {row.field}={wanted} says ({row.seen}), while megatron-core computes "
                         f"with {wanted}: the logits differ for that reason, not the conversion's; verify with a "
                         f"transformers that reads {row.field}")
    return found
