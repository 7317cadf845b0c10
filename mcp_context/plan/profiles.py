"""Machine profiles for the planner: link bandwidths and latencies, attention throughput, memory.

A profile is a small YAML file (shipped ones live in ``profiles/``: ``h100_nvlink_ib``,
``h200_nvlink_ib``); ``load_profile`` takes a shipped name or a path to an edited copy and refuses
missing, unknown or non-positive fields by name. This module owns only the numbers; how they turn
into times is ``cost.py``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

PROFILE_DIR = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class MachineProfile:
    """One GPU type and its fabric; bandwidths per GPU and per direction, in GB/s (1e9 bytes)."""

    name: str
    gpus_per_node: int
    intra_node_bandwidth_gbps: float
    inter_node_bandwidth_gbps: float
    intra_node_latency_us: float
    inter_node_latency_us: float
    attention_tflops: float
    attention_bwd_tflops: float
    memory_gib: float


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str) -> MachineProfile:
    """A shipped profile by name (``h100_nvlink_ib``) or a YAML file by path."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ValueError(f"profile={name_or_path!r} is neither a file nor a shipped profile; use one of "
                         f"{', '.join(shipped_profiles())} or a path to a YAML file like them")
    data = yaml.safe_load(path.read_text()) or {}
    fields = {f.name: f.type for f in dataclasses.fields(MachineProfile)}
    unknown = sorted(set(data) - set(fields))
    missing = sorted(set(fields) - set(data))
    if unknown or missing:
        raise ValueError(f"profile {path}: unknown fields {unknown}, missing fields {missing}; "
                         f"a profile has exactly {', '.join(fields)}")
    for key, value in data.items():
        if key != "name" and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"profile {path}: {key}={value!r} must be a positive number")
    if not isinstance(data["gpus_per_node"], int):
        raise ValueError(f"profile {path}: gpus_per_node={data['gpus_per_node']!r} must be an integer")
    return MachineProfile(**data)
