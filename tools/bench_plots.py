"""Plots of ``tools/bench_attention.py``'s results (PNG, matplotlib's Agg backend)."""
from __future__ import annotations

import os
import statistics

from mcp_context.cp_rules import COMM_TYPES


def plot(results: dict, out_dir: str, suffix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    cpu = results.get("cpu", {})
    if cpu:
        width = max(len(res["configs"]) for res in cpu.values())
        fig, axes = plt.subplots(len(cpu), 1, figsize=(1.0 * width + 2, 4 * len(cpu)), squeeze=False)
        for ax, (world, res) in zip(axes[:, 0], cpu.items()):
            labels = [f"{c['comm']}\n{c['layout']}" for c in res["configs"]]
            x = range(len(labels))
            ax.bar([i - 0.2 for i in x], [c["ratio_fwd"] for c in res["configs"]], 0.4, label="forward")
            ax.bar([i + 0.2 for i in x], [c["ratio_fwd_bwd"] for c in res["configs"]], 0.4, label="forward+backward")
            ax.axhline(1.0, color="k", lw=0.8)
            ax.axhline(1.3, color="r", lw=0.8, ls="--", label="1.3x")
            ax.set_xticks(list(x), labels, fontsize=7)
            ax.set_title(f"P={world}: time / single-process full attention (median)")
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, f"bench_cpu_ratio{suffix}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

        fig, axes = plt.subplots(len(cpu), 1, figsize=(11, 1.2 + 1.1 * sum(int(w) for w in cpu)), squeeze=False)
        colors = {"forward_compute": "tab:blue", "backward_compute": "tab:green", "kv_wait": "tab:red",
                  "dkv_wait": "tab:orange"}
        for ax, (world, res) in zip(axes[:, 0], cpu.items()):
            tl = res["timeline"]
            for rank, events in enumerate(tl["events_per_rank"]):
                for e in events:
                    ax.barh(rank, (e["t1"] - e["t0"]) * 1e3, left=e["t0"] * 1e3, color=colors[e["kind"]],
                            edgecolor="k", lw=0.3)
                    if e["kind"].endswith("compute"):
                        ax.text((e["t0"] + e["t1"]) / 2 * 1e3, rank, str(e["step"]), ha="center", va="center",
                                fontsize=7, color="w")
            alone = statistics.median(tl["transfer_alone_s"]) * 1e3
            ax.set_title(f"p2p zigzag, P={world}: per-step compute and time blocked on the next shard "
                         f"(one K/V transfer alone: {alone:.1f} ms)", fontsize=9)
            ax.set_yticks(range(int(world)), [f"rank {r}" for r in range(int(world))])
            ax.set_xlabel("ms")
            ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()],
                      labels=list(colors), fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        fig.tight_layout()
        paths.append(os.path.join(out_dir, f"bench_overlap_timeline{suffix}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    devices = results.get("device") or []
    for dev in devices if isinstance(devices, list) else [devices]:  # older runs stored one dict
        rows = [r for r in dev["kernels"] if "fwd_tflops" in r]
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 3.8))
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["fwd_tflops"] for r in rows], 0.4, label="forward")
        ax.bar([i + 0.2 for i in x], [r["fwd_bwd_tflops"] for r in rows], 0.4, label="forward+backward")
        ax.set_xticks(list(x), [r["kernel"] for r in rows])
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"block kernels ({dev['dtype']}, causal block of {dev['block_len']})", fontsize=9)
        ax.legend(fontsize=8)
        sched = [r for r in dev["rank_schedule"] if "error" not in r and r.get("comm", COMM_TYPES[0]) == COMM_TYPES[0]]  # a row that ran out of memory has no times
        x = range(len(sched))
        for offset, (label, key) in zip((-0.3, -0.1, 0.1, 0.3), [("ours fwd", ("fwd", "ours_tflops")),
                                                                   ("fused fwd", ("fwd", "fused_tflops")),
                                                                   ("ours fwd+bwd", ("fwd_bwd", "ours_tflops")),
                                                                   ("fused fwd+bwd", ("fwd_bwd", "fused_tflops"))]):
            ax2.bar([i + offset for i in x], [r[key[0]][key[1]] for r in sched], 0.2, label=label)
        ax2.set_xticks(list(x), [f"P={r['world_size']}\n{r['fwd_bwd']['efficiency']:.2f} of fused" for r in sched])
        ax2.set_ylabel("TFLOP/s")
        seq = dev.get("seq_len", results["shape"]["seq_len"])
        ax2.set_title(f"rank 0's zigzag schedule vs one fused SDPA of equal useful FLOPs ({dev['device']}, S={seq})",
                      fontsize=9)
        ax2.legend(fontsize=8)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, f"bench_device_kernels{suffix}_s{seq}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
