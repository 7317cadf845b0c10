"""CPU shim for megatron-core's hybrid context parallelism (dynamic CP): its schedule, loader and batch slicing.

Targets megatron-core 0.16.x (seen on 0.16.1). `apply_hybrid_cp_on_cpu(device)` patches when the run is
on the CPU (``device="cpu"``; with no device, when CUDA is absent). Each function below places tensors on
CUDA by hand; it runs unchanged inside a scope where ``torch.cuda.current_device()`` answers the CPU,
factories asked for ``device="cuda"`` build on the CPU, ``pin_memory=True`` is dropped and
``Tensor.cuda()`` keeps the tensor where it is. Each is patched only if its code (or, for the loader,
the code of one of its methods) still names CUDA:

- `schedules.forward_backward_no_pipelining` (``total_num_tokens`` on ``device="cuda"``), which calls
- `hybrid_cp_schedule.hybrid_context_parallel_forward_backward` (the number of sub-samples per group on
  ``torch.cuda.current_device()``), and so the model's forward and backward too run in that scope;
- `data_schedule.HybridCPDataLoaderWrapper.__next__` (lengths and ids moved with ``.cuda()``, the reroute
  buffers on the current device);
- `utils.get_batch_on_this_hybrid_cp_rank` (``cu_seqlens`` pinned on ``device="cuda"``).

Not covered: the TE attention megatron-core pairs with it (mcp_context's core attention replaces it).
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

import torch
from megatron.core import utils as mcore_utils
from megatron.core.datasets import data_schedule
from megatron.core.pipeline_parallel import hybrid_cp_schedule, schedules
from torch.overrides import TorchFunctionMode

from megatron_patches._patching import is_patched, qualified_name, replace_attribute, run_inside
from megatron_patches.cpu_shims import DeviceLike, _current_device_is_cpu, runs_on_cpu


class _CudaStaysOnCpu(TorchFunctionMode):
    """Inside the mode: ``device="cuda"`` builds on the CPU, ``pin_memory`` is off, ``Tensor.cuda()`` is a no-op."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.cuda:
            return args[0]
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


@contextlib.contextmanager
def _on_cpu() -> Iterator[None]:
    with _current_device_is_cpu(), _CudaStaysOnCpu():
        yield


def _names_cuda(function: Any) -> bool:
    """Probe: does the code of `function` name CUDA (a ``"cuda"`` literal, ``.cuda()`` or ``current_device``)?"""
    code = getattr(inspect.unwrap(function), "__code__", None)
    return code is not None and ("cuda" in code.co_consts or {"cuda", "current_device"} & set(code.co_names) != set())


def _loader_names_cuda() -> bool:
    cls = data_schedule.HybridCPDataLoaderWrapper
    return any(_names_cuda(member) for member in vars(cls).values() if inspect.isfunction(member))


def _shims() -> list[tuple[Any, str, Callable[[], bool]]]:
    return [
        (schedules, "forward_backward_no_pipelining", lambda: _names_cuda(schedules.forward_backward_no_pipelining)),
        (hybrid_cp_schedule, "hybrid_context_parallel_forward_backward",
         lambda: _names_cuda(hybrid_cp_schedule.hybrid_context_parallel_forward_backward)),
        (data_schedule.HybridCPDataLoaderWrapper, "__next__", _loader_names_cuda),
        (mcore_utils, "get_batch_on_this_hybrid_cp_rank", lambda: _names_cuda(mcore_utils.get_batch_on_this_hybrid_cp_rank)),
    ]


def apply_hybrid_cp_on_cpu(device: DeviceLike = None) -> list[str]:
    """Run megatron-core's hybrid-CP schedule, loader and batch slicing on the CPU when `device` is the CPU
    (None: when CUDA is absent), for the rest of the process. Idempotent. Returns the names patched now."""
    if not runs_on_cpu(device):
        return []
    needed = [(owner, name) for owner, name, probe in _shims() if not is_patched(owner, name) and probe()]
    return [qualified_name(owner, name) for owner, name in needed if replace_attribute(owner, name, run_inside(_on_cpu))]
