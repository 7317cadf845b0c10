"""On a CUDA GPU (skipped elsewhere): the Megatron GPT with our layer spec, and the pretrain entry in bf16;
on the CPU, how those GPU runs are launched (the subprocess's PYTHONPATH, ``tools/gpu_checks.sh``'s refusal
of a python without CUDA torch).

- Parity: the tiny GPT (RoPE, GQA, SwiGLU, RMSNorm) with ``get_gpt_layer_hcp_spec()`` on one GPU at
  CP=1 against megatron-core's stock local spec with the same weights: per-token loss and every
  gradient within 1e-4 (fp32, TF32 off), and within 3e-2 relative of the loss in bf16; the same with
  ``step_graphs=True`` (the attention step replayed from CUDA graphs; not yet run on a GPU).
- Training: ``torchrun --nproc-per-node 1 -m mcp_context.pretrain`` trains the tiny recipe in bf16 on the
  GPU (CP 1, ``train.device=cuda``): it exits 0, every loss is finite and the last is below the first.
  Its subprocess gets the repository *prepended* to ``PYTHONPATH`` (``with_repo_on_pythonpath``, tested
  on the CPU): a megatron-core installed outside site-packages (``pip --target``) stays importable.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._dist import run_distributed
from tests.tiny_gpt import batch, init_parallel, tiny_config, tiny_gpt

REPO = Path(__file__).resolve().parents[1]
SEQ = 16


def with_repo_on_pythonpath(env: dict) -> dict:
    """``env`` with the repository first on ``PYTHONPATH`` and every path it already held kept after it."""
    return {**env, "PYTHONPATH": os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                                if p])}


def test_the_subprocess_pythonpath_extends_the_callers():
    """CPU: the caller's PYTHONPATH entries survive, after the repository; an empty one adds nothing."""
    env = with_repo_on_pythonpath({"PYTHONPATH": os.pathsep.join(["/tmp/site", "/opt/megatron"]), "HOME": "/h"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/tmp/site", "/opt/megatron"] and env["HOME"] == "/h"
    assert with_repo_on_pythonpath({})["PYTHONPATH"] == with_repo_on_pythonpath({"PYTHONPATH": ""})["PYTHONPATH"] \
        == str(REPO)


def _parity(rank, world, dtype_name, step_graphs=False):
    import megatron_patches
    from megatron.core import parallel_state

    from mcp_context.megatron.specs import get_gpt_layer_hcp_spec

    dtype = getattr(torch, dtype_name)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    megatron_patches.apply_all(device="cuda")
    init_parallel()
    try:
        config = tiny_config(params_dtype=dtype, bf16=dtype == torch.bfloat16)
        stock = tiny_gpt(config, seq=SEQ).cuda()
        ours = tiny_gpt(config, get_gpt_layer_hcp_spec(step_graphs=step_graphs), seq=SEQ).cuda()
        ours.load_state_dict(stock.state_dict())
        tokens, positions, labels = (x.cuda() for x in batch(SEQ))
        results = []
        for model in (stock, ours):
            loss = model(tokens, positions, None, labels=labels)
            loss.float().sum().backward()
            results.append((loss.detach().float().cpu(),
                            {n: p.grad.float().cpu() for n, p in model.named_parameters()}))
        (ref_loss, ref_grads), (loss, grads) = results
        return ((loss - ref_loss).abs().max().item(), ref_loss.abs().max().item(),
                max((grads[n] - g).abs().max().item() for n, g in ref_grads.items()))
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: the script would run its checks")
def test_gpu_checks_refuse_a_python_without_cuda_naming_the_fix(tmp_path):
    """CPU: ``make test-gpu`` / ``tools/gpu_checks.sh`` with a python that has no CUDA torch stops at once
    (exit 2) and says to point ``PYTHON`` at the CUDA environment's python; no step runs."""
    proc = subprocess.run(["bash", str(REPO / "tools" / "gpu_checks.sh"), str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 2 and "has no CUDA torch" in proc.stderr and "PYTHON=/path/to" in proc.stderr
    assert (tmp_path / "summary.jsonl").read_text() == ""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpt_with_our_spec_matches_the_stock_spec_on_cuda_fp32():
    loss_err, _, grad_err = run_distributed(1, _parity, "float32")[0]
    assert loss_err <= 1e-4 and grad_err <= 1e-4, (loss_err, grad_err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpt_with_our_spec_matches_the_stock_spec_on_cuda_bf16():
    loss_err, magnitude, _ = run_distributed(1, _parity, "bfloat16")[0]
    assert loss_err <= 3e-2 * magnitude, (loss_err, magnitude)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype_name, tol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_gpt_with_step_graphs_matches_the_stock_spec_on_cuda(dtype_name, tol):
    """``get_gpt_layer_hcp_spec(step_graphs=True)`` at CP=1 (each layer's attention step replayed from CUDA
    graphs) against megatron-core's stock local spec: the loss within the tolerances above (fp32 absolute,
    bf16 relative to the loss), and in fp32 every gradient within 1e-4. Not yet run on a GPU."""
    loss_err, magnitude, grad_err = run_distributed(1, _parity, dtype_name, True)[0]
    assert loss_err <= tol * (magnitude if dtype_name == "bfloat16" else 1), (loss_err, magnitude)
    assert dtype_name == "bfloat16" or grad_err <= 1e-4, grad_err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pretrain_trains_the_tiny_recipe_in_bf16_on_one_gpu(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "mcp_context.pretrain",
           "--recipe", str(REPO / "recipes" / "tiny_cpu.yaml"), "--run-dir", str(run_dir),
           "model.context_parallel_size=1", "model.hierarchical_context_parallel_sizes=null",
           "model.cp_comm_type=p2p", "model.bf16=true", "model.params_dtype=bfloat16", "train.world_size=1", "train.device=cuda",
           "train.steps=30", "train.eval_interval=30", "train.eval_iters=1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=with_repo_on_pythonpath(dict(os.environ)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 30 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("comm", ["p2p", "all_gather", "a2a", "a2a+p2p", "a2a+all_gather"])
def test_a_rank_step_never_waits_for_the_gpu(comm):
    """One rank's fwd+bwd at 8K over 8 ranks (as the benchmark runs it: a ring walked through its messages,
    K/V packed where a collective moved them) under ``torch.cuda.set_sync_debug_mode("error")``: any
    synchronising call (``.item()``, a device-to-host copy, ``nonzero``) raises. Passes on an H200 (2026-11-26)."""
    from mcp_context.kernels.torch_sdpa import FUSED_OPS, TorchKernel
    from mcp_context.masks import CAUSAL
    from tools.rank_step import rank_step, walked_call

    step = rank_step(comm, 8, 8192, CAUSAL, TorchKernel(FUSED_OPS["cudnn"]), 32, 8, 128)
    g = torch.Generator(device="cuda").manual_seed(0)
    call = walked_call(step, lambda *shape: torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16), 128)
    call()  # warm-up: compiles the merges, builds cuDNN's plans
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
