"""tools/rehearse_memory.py: one rank's rehearsed peak against the fused call's, on fake CUDA tensors."""
import json

from tools.rehearse_memory import main


def test_the_peak_is_the_same_whether_the_regions_run_eagerly_or_do_nothing(capsys):
    """The rehearsal counts the fused regions' eager temporaries unless ``--idle-regions`` (as compiled on a GPU,
    they allocate nothing): at this shape the peak of a zigzag member's step is not at a merge, so both give the
    same peak (as at 32K and 128K over 8 ranks, docs/performance.md). The eager form does allocate: a merge
    rehearsed alone holds more with it than without (so the equality above is about where the peak is)."""
    rows = []
    for flags in ([], ["--idle-regions"]):
        assert main(["--seq-len", "2048", "--cp", "4", "--rank", "1", "--heads", "4", "--kv-heads", "2",
                     "--head-dim", "16", *flags]) == 0
        rows.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    eager, idle = rows
    assert (eager["idle_regions"], idle["idle_regions"]) == (False, True)
    assert eager["rank_peak_mib"] == idle["rank_peak_mib"] > 0 and eager["fused_peak_mib"] == idle["fused_peak_mib"]
    assert eager["ratio"] > 0


def test_the_eager_merge_allocates_what_the_idle_region_does_not():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from mcp_context.merge import merge_blocks_
    from tools.rank_step import regions_doing_nothing

    def peak(idle: bool) -> int:
        with FakeTensorMode():
            cuda = torch.device("cuda")
            out = torch.empty(1, 4, 256, 16, device=cuda, dtype=torch.bfloat16)
            lse = torch.empty(1, 4, 256, device=cuda)
            blocks = [t for _ in range(3) for t in (torch.empty(1, 4, 256, 16, device=cuda, dtype=torch.bfloat16),
                                                   torch.empty(1, 4, 256, device=cuda))]
            tracker = MemTracker()
            with tracker, regions_doing_nothing() if idle else torch.no_grad():
                merge_blocks_(out, lse, *blocks)
            return sum(kinds["Total"] for dev, kinds in tracker.get_tracker_snapshot("peak").items()
                       if dev.type == "cuda")
    assert peak(idle=False) > peak(idle=True) == 0  # the eager form's fp32 sum and factors; nothing idle
