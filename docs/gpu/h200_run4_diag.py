"""The script that wrote h200_run4_diag.log, kept as the record of that run (it ran from the repository
root on the device, as ``python3 <this file>``). (1) the side-stream vs in-order mismatch at p2p rank 3,
with compiled and with eager merges; (2) where the host's time goes in p2p's 32K/P8 fwd+bwd step (cProfile), side stream and in order."""
import cProfile, inspect, io, pstats, sys, time
import torch
sys.path.insert(0, ".")
from mcp_context import merge
from mcp_context.algorithms import streams
from mcp_context.algorithms.executor import RingAttention, ring_backward, ring_forward
from mcp_context.algorithms.packing import unpacked
from mcp_context.kernels.torch_sdpa import FUSED_OPS, TorchKernel
from mcp_context.masks import CAUSAL
from tools.rank_step import kv_inputs, rank_step

print("torch", torch.__version__, "recompile_limit kwarg:", "recompile_limit" in inspect.signature(torch.compile).parameters, flush=True)
kernel = TorchKernel(FUSED_OPS["cudnn"])
FUSED = [merge._merge_pair, merge._add_pair, merge._add_kv, merge._copy_kv]


def side_vs_inline(rank, eager):
    for f in FUSED:
        f.error = "forced eager (diagnostic)" if eager else None
    step = rank_step("p2p", 8, 32768, CAUSAL, kernel, 32, 8, 128, rank=rank)
    plan, kv_rows = step.plan, step.kv_rows
    g = torch.Generator(device="cuda").manual_seed(rank)
    q, dout = (torch.randn(step.q_rows, 1, 32, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(kv_rows, 1, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    after = streams.SideStream.after

    def late(self, *outputs):
        scope = after(self, *outputs)
        with torch.cuda.stream(self.side):
            torch.cuda._sleep(1_000_000)
        return scope

    def run(p):
        o, l = ring_forward(q, k, v, p)
        return [o, l, *ring_backward(dout, q, k, v, o, l, p)[:3]]
    with streams.inline():
        want = run(plan)
    want2 = None
    with streams.inline():
        want2 = run(plan)
    streams.SideStream.after = late
    try:
        got = run(plan)
    finally:
        streams.SideStream.after = after
    torch.cuda.synchronize()
    for name, a, b, c in zip(("out", "lse", "dq", "dk", "dv"), got, want, want2):
        d = (a.float() - b.float()).abs()
        rows = (d.reshape(-1, d.shape[-1]) > 0).any(-1).sum().item() if d.dim() > 2 else None
        print(f"  rank {rank} {'eager' if eager else 'compiled'} {name}: side-vs-inline max {d.max().item():.3e}, "
              f"{(d > 0).sum().item()} of {d.numel()} differ (rows {rows}); inline twice equal {torch.equal(b, c)}; "
              f"max |want| {b.float().abs().max().item():.3e}", flush=True)
    print("  fused errors:", [f.error for f in FUSED], flush=True)


# host profile of p2p 32K/P8 fwd+bwd, as the benchmark runs it (walked ring)
step = rank_step("p2p", 8, 32768, CAUSAL, kernel, 32, 8, 128)
plan, kv_rows = step.walked()
rand = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)
q = rand(step.q_rows, 1, step.heads, 128).requires_grad_()
k, v = kv_inputs(step, lambda dims: rand(kv_rows, 1, step.kv_heads, dims).requires_grad_(), 128, unpacked)
do = rand(step.q_rows, 1, step.heads, 128)


def call():
    out, _ = RingAttention.apply(q, k, v, plan)
    out.backward(do)


def fwd():
    with torch.no_grad():
        RingAttention.apply(q, k, v, plan)


for mode in ("side", "inline"):
    ctx = streams.inline() if mode == "inline" else __import__("contextlib").nullcontext()
    with ctx:
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        hosts = []
        for _ in range(5):
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)  # ~100 ms: the GPU busy, the host ahead
            t0 = time.perf_counter(); call(); hosts.append(time.perf_counter() - t0)
        fh = []
        for _ in range(5):
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)
            t0 = time.perf_counter(); fwd(); fh.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        print(f"{mode}: host issue fwd+bwd ms {[round(h * 1e3, 2) for h in hosts]}, fwd ms {[round(h * 1e3, 2) for h in fh]}", flush=True)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(10):
            call()
        pr.disable()
        torch.cuda.synchronize()
        for key, n in (("tottime", 45), ("cumtime", 40)):
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats(key).print_stats(n)
            print(f"--- {mode} by {key} (10 steps)\n" + buf.getvalue(), flush=True)

for rank in (3,):
    side_vs_inline(rank, eager=False)
side_vs_inline(3, eager=True)
for f in FUSED:
    f.error = None

