"""The opt-in ring timeline records every step's compute and wait, in order, and nothing when off.

p2p zigzag at P=2, forward+backward on gloo: forward_compute and backward_compute for steps 0 and 1,
one kv_wait (step 1) in each pass, dK/dV waits for steps 1 and 2 (the last one brings the shard's
gradient home); every wait starts after the compute it follows, and events are time-ordered.
"""
import pytest
import torch

from mcp_context import trace
from tests._dist import run_distributed


def _record(rank, world):
    from mcp_context import context_parallel_attention

    q, k, v = (torch.randn(8, 1, 4, 8, requires_grad=True) for _ in range(3))

    def run():
        context_parallel_attention(q, k, v, None, layout="zigzag", comm="p2p").sum().backward()

    run()
    off_before = trace._current is None
    with trace.record_timeline() as tl:
        run()
    run()  # after the context: nothing more is recorded
    return off_before and trace._current is None, [(e.kind, e.step, e.t0, e.t1) for e in tl.events]


def test_timeline_records_each_step_in_order_and_nothing_when_off():
    for rank, (off, events) in enumerate(run_distributed(2, _record)):
        assert off, rank
        # backward: K/V and the partial dK/dV sum travel in one message; a step waits for the partial sum of
        # the shard it holds at its first add (inside its compute, after the first block), then sums go home
        assert [(kind, step) for kind, step, *_ in events] == [
            ("forward_compute", 0), ("kv_wait", 1), ("forward_compute", 1),
            ("backward_compute", 0), ("kv_wait", 1), ("dkv_wait", 1), ("backward_compute", 1), ("dkv_wait", 2),
        ], (rank, events)
        assert all(t0 <= t1 for *_, t0, t1 in events)
        inside = events[5]  # dkv_wait 1 lies within backward_compute 1; every other event follows the one before
        assert events[6][2] <= inside[2] <= inside[3] <= events[6][3], events
        rest = events[:5] + events[6:]
        assert all(a[3] <= b[2] for a, b in zip(rest, rest[1:])), "events overlap or are out of order"


def test_nested_recording_is_refused():
    with trace.record_timeline():
        with pytest.raises(RuntimeError, match="already recording"):
            with trace.record_timeline():
                pass
    assert trace._current is None
