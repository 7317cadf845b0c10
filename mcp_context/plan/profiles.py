"""Machine profiles for the planner: link bandwidths and latencies, attention throughput, memory.

A profile is a small YAML file (shipped ones live in ``profiles/``: ``h100_nvlink_ib``,
``h200_nvlink_ib``); ``load_profile`` takes a shipped name or a path to an edited copy and refuses
missing, unknown or non-positive fields by name. The attention rates are tables by block shape (short
blocks run far below long ones: 98 against 585 TFLOP/s forward+backward at 1K and 16K rows on an H200),
with a per-call overhead and the bandwidth of the step's other work, fitted to a measured rank step
(``tools/calibrate_profile.py``), and the host's time to issue a step (a short step is bound by it);
``measured`` says where each figure comes from. This module owns only the numbers; how they turn
into times is ``cost.py``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..algorithms.calls import Gpu

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
    memory_gib: float
    causal_tflops: tuple[tuple[float, float, float], ...]
    """The fused op on causal squares: ``(rows, forward TFLOP/s, forward+backward TFLOP/s)`` rows, by
    rows (FLOPs: ``4 d`` per visible pair and head forward, 3.5x that forward+backward)."""
    full_tflops: tuple[tuple[float, float, float], ...]
    """The same for full blocks, by the causal length of equal pairs, ``sqrt(2 * pairs)``. Both tables are
    measured with calls that fill the GPU (32 heads: every row has thread blocks for all its SMs)."""
    sm_count: int
    """The GPU's streaming multiprocessors: a call with fewer thread blocks' worth of work leaves SMs idle
    (``cost.occupancy``)."""
    attention_tile_rows: int
    """Rows of one thread block of the fused op: a query tile forward, a key tile backward (128 for the
    Hopper kernels cuDNN and flash-attention run at head dim 128)."""
    call_overhead_us: float
    """Fixed cost of one attention call beyond its FLOPs at the table's rate (fitted to a measured step)."""
    memory_bandwidth_gbps: float
    """Effective GB/s of the step's merges, accumulations and copies (fitted to a measured profile)."""
    host_layer_us: float
    """The host's time to issue one attention layer's forward and backward beyond its calls (the autograd
    function, the plan's walk; fitted to measured host issue times, ``tools/calibrate_profile.py``). A
    property of the host CPU and the torch build as much as of the GPU."""
    host_call_us: float
    """The host's time to issue one attention call's forward and backward with the work after it (the op,
    its merges, sums and transfers), fitted with ``host_layer_us``."""
    measured: str
    """Where the figures come from: machine, software, command and date; what is not measured."""

    @property
    def gpu(self) -> Gpu:
        """What the executor plans its calls by on this GPU (``algorithms/calls.py``)."""
        return Gpu(self.sm_count, self.attention_tile_rows)


TABLES = ("causal_tflops", "full_tflops")
INTEGERS = ("gpus_per_node", "sm_count", "attention_tile_rows")


def _table(path: Path, key: str, value: object) -> tuple[tuple[float, float, float], ...]:
    """A rate table: at least one ``[length, forward TFLOP/s, forward+backward TFLOP/s]`` row, positive
    numbers, lengths increasing."""
    ok = isinstance(value, list) and value and all(
        isinstance(r, list) and len(r) == 3 and all(isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0
                                                    for x in r) for r in value)
    if not ok or any(a[0] >= b[0] for a, b in zip(value, value[1:])):
        raise ValueError(f"profile {path}: {key}={value!r} must be a list of [length, fwd TFLOP/s, fwd+bwd TFLOP/s] "
                         f"rows of positive numbers with increasing lengths, e.g. [[4096, 448, 453], [16384, 645, 585]]")
    return tuple(tuple(float(x) for x in r) for r in value)


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
        if key in TABLES:
            data[key] = _table(path, key, value)
        elif key not in ("name", "measured") and (isinstance(value, bool) or not isinstance(value, (int, float))
                                                  or value <= 0):
            raise ValueError(f"profile {path}: {key}={value!r} must be a positive number")
    for key in INTEGERS:
        if not isinstance(data[key], int):
            raise ValueError(f"profile {path}: {key}={data[key]!r} must be an integer")
    return MachineProfile(**data)
