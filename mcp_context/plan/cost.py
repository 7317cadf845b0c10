"""Predicted attention time of one layer, from the schedule, the dry run's bytes and a machine profile.

The model follows the engine step by step. Ranks move through the ring in lockstep, so a step costs
the slowest member's compute (its tasks in the schedule, ``4*d`` FLOPs per visible pair and head
forward, 2.5x that backward: the backward recomputes the scores) and the slowest rank's transfer.
A transfer to a peer on the same node runs at the NVLink bandwidth, to another node at the network
bandwidth; a collective whose peers are on both runs on both at once (the slower part counts).

- Forward: the all-to-all / all-gather is exposed; ring step ``t`` computes while the shard for
  step ``t+1`` travels: ``sum_t max(compute_t, transfer_t)`` with overlap, the plain sum without.
- Backward: during step ``t`` the next K/V shard and the dK/dV of step ``t-1`` are in flight; the
  last dK/dV (going home) is exposed.

Bytes come from the dry run of the real comm code; only their split over steps is by count of
transfers (every ring transfer of a pass has the same size).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..schedule import Schedule
from .dryrun import RankShape, RankTraffic
from .profiles import MachineProfile

BACKWARD_FLOP_FACTOR = 2.5  # QK^T, dP = dO V^T, dV, dQ, dK: five matmuls for forward's two


@dataclass(frozen=True)
class Prediction:
    """Seconds for one attention layer on one rank, forward and backward, with and without overlap."""

    forward_s: float
    backward_s: float
    forward_no_overlap_s: float
    backward_no_overlap_s: float
    compute_s: float
    """Forward + backward compute alone (the lower bound)."""
    ring_step_compute_s: float = 0.0
    """Forward compute of the slowest off-diagonal ring step (what a transfer hides behind)."""
    ring_step_transfer_s: float = 0.0
    """Forward K/V transfer of one ring step (slowest rank)."""

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def total_no_overlap_s(self) -> float:
        return self.forward_no_overlap_s + self.backward_no_overlap_s


class Fabric:
    """Where each rank's transfers go: node of a CP rank is ``tp * cp_rank // gpus_per_node``."""

    def __init__(self, profile: MachineProfile, tp: int):
        self.profile, self.tp = profile, tp

    def node(self, cp_rank: int) -> int:
        return self.tp * cp_rank // self.profile.gpus_per_node

    def intra_fraction(self, traffic: RankTraffic, op: str) -> float:
        """Share of this rank's bytes of operation ``op`` that go to peers on its own node."""
        dests = traffic.destinations.get(op, {})
        total = sum(dests.values())
        if not total:
            return 1.0
        here = self.node(traffic.cp_rank)
        return sum(b for peer, b in dests.items() if self.node(peer) == here) / total

    def seconds(self, nbytes: float, intra_fraction: float, transfers: int = 1) -> float:
        """Time for ``nbytes`` split over NVLink and the network, plus ``transfers`` latencies."""
        if nbytes <= 0:
            return 0.0
        p = self.profile
        wire = max(nbytes * intra_fraction / (p.intra_node_bandwidth_gbps * 1e9),
                   nbytes * (1 - intra_fraction) / (p.inter_node_bandwidth_gbps * 1e9))
        latency = p.intra_node_latency_us if intra_fraction == 1.0 else p.inter_node_latency_us
        return wire + transfers * latency * 1e-6

    def split(self, traffic: RankTraffic, ops: dict[str, int]) -> tuple[int, int]:
        """``(intra_node_bytes, inter_node_bytes)`` of ``ops`` (comm_stats bytes by operation)."""
        intra = sum(b * self.intra_fraction(traffic, op) for op, b in ops.items())
        return round(intra), round(sum(ops.values()) - intra)


def step_pairs(schedule: Schedule) -> list[int]:
    """Visible pairs of the slowest member at each ring step (ranks move in lockstep)."""
    return [max(sum(t.useful_pairs for t in schedule.tasks[m][step]) for m in range(schedule.ring_size))
            for step in range(schedule.ring_size)]


def _collective_seconds(fabric: Fabric, traffic: RankTraffic, ops: dict[str, int], calls: dict[str, int]) -> float:
    return sum(fabric.seconds(b, fabric.intra_fraction(traffic, op), calls.get(op, 0))
               for op, b in ops.items() if not op.startswith("ring_"))


def predict(schedule: Schedule, shape: RankShape, a2a_degree: int, traffics: Sequence[RankTraffic],
            fabric: Fabric) -> Prediction:
    """Forward and backward time of one attention layer (slowest rank of ``traffics`` at every step)."""
    p = fabric.profile
    flops_per_pair = 2 * (shape.head_dim + shape.dv) * shape.batch * shape.heads // a2a_degree  # QK^T and PV
    pairs = step_pairs(schedule)
    c_fwd = [n * flops_per_pair / (p.attention_tflops * 1e12) for n in pairs]
    c_bwd = [n * flops_per_pair * BACKWARD_FLOP_FACTOR / (p.attention_bwd_tflops * 1e12) for n in pairs]
    steps = len(pairs)

    def ring_transfer(kv_fwd: bool, kv_bwd: bool, dkv: bool) -> float:
        """Slowest rank's time for one step's ring traffic of the given kinds."""
        worst = 0.0
        for tr in traffics:
            nbytes = 0.0
            if kv_fwd:
                nbytes += tr.forward.get("ring_kv", 0) / max(steps - 1, 1)
            if kv_bwd:
                nbytes += tr.backward.get("ring_kv", 0) / max(steps - 1, 1)
            if dkv:
                nbytes += tr.backward.get("ring_dkv", 0) / steps
            worst = max(worst, fabric.seconds(nbytes, fabric.intra_fraction(tr, "ring_kv")))
        return worst

    coll_fwd = max(_collective_seconds(fabric, tr, tr.forward, tr.calls_forward) for tr in traffics)
    coll_bwd = max(_collective_seconds(fabric, tr, tr.backward, tr.calls_backward) for tr in traffics)
    ringed = any(tr.forward.get("ring_kv") for tr in traffics)
    m_fwd = [ring_transfer(ringed and t < steps - 1, False, False) for t in range(steps)]
    m_bwd = [ring_transfer(False, ringed and t < steps - 1, ringed and t >= 1) for t in range(steps)]
    tail = ring_transfer(False, False, ringed)
    forward = coll_fwd + sum(max(c, m) for c, m in zip(c_fwd, m_fwd))
    backward = coll_bwd + sum(max(c, m) for c, m in zip(c_bwd, m_bwd)) + tail
    kv_bwd = [ring_transfer(False, ringed and t < steps - 1, False) for t in range(steps)]
    forward_serial = coll_fwd + sum(c_fwd) + sum(m_fwd)
    backward_serial = coll_bwd + sum(c_bwd) + sum(kv_bwd) + steps * tail
    return Prediction(forward, backward, forward_serial, backward_serial, sum(c_fwd) + sum(c_bwd),
                      max(c_fwd[1:], default=0.0), max(m_fwd, default=0.0))
