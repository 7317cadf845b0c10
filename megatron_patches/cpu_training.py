"""CPU shims for training: megatron-core's DDP grad buffers, FP32 optimizer and gradient clipping.

Targets megatron-core 0.16.x (seen on 0.16.1). `apply_cpu_training_shims(device)` patches when the run
is on the CPU (``device="cpu"``; with no device, when CUDA is absent), each behind a probe that reads
the CUDA use in the function's code (so a release that fixed one is left alone):

- `_ParamAndGradBuffer.__init__` allocates the DDP grad (and param) buffers on
  ``torch.cuda.current_device()``: it runs with the current device answering the CPU;
- `FP32Optimizer.__init__` (its loss scale of 1) and `get_grad_norm_fp32` (and megatron's
  pure-torch ``local_multi_tensor_l2_norm`` it calls without apex/TE) create tensors with
  ``device='cuda'``: they run with tensor factories asked for a CUDA device placing them on the CPU;
- `clip_grad_by_total_norm_fp32` asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``: it is
  replaced by the same scaling (grads times ``max_norm / (total_norm + 1e-6)`` when that is below 1)
  without the device assertion.

Together these let `megatron.core.distributed.DistributedDataParallel`,
`megatron.core.optimizer.get_megatron_optimizer` (fp32 parameters, plain optimizer) and its
gradient clipping train a model on gloo. Not covered: the mixed-precision (fp16/bf16) optimizer,
the distributed optimizer, overlapped grad reduction (CUDA streams), and megatron-core's own
``torch_dist`` checkpoint writer (``mcp_context.pretrain.checkpoint`` writes the same format
in-process on CPU instead).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, List, Union

import torch
from megatron.core.distributed import param_and_grad_buffer
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer import optimizer as mcore_optimizer
from torch.overrides import TorchFunctionMode

from megatron_patches._patching import is_patched, qualified_name, replace_attribute, run_inside
from megatron_patches.cpu_shims import DeviceLike, _calls_current_device, _on_cpu_current_device, runs_on_cpu


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """Inside the mode, a tensor factory called with a CUDA ``device=`` places the tensor on the CPU."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _code_constants(function: Any) -> tuple:
    code = getattr(inspect.unwrap(function), "__code__", None)
    return code.co_consts if code is not None else ()


def _names_cuda(owner: Any, name: str) -> bool:
    """Probe: does the code of `owner.name` hold a ``'cuda'`` device literal?"""
    return "cuda" in _code_constants(getattr(owner, name, None))


def _asserts_cuda_grads(owner: Any, name: str) -> bool:
    """Probe: does the code of `owner.name` compare a tensor type with ``'torch.cuda.FloatTensor'``?"""
    return "torch.cuda.FloatTensor" in _code_constants(getattr(owner, name, None))


_with_cuda_factories_on_cpu = run_inside(_CudaFactoriesOnCpu)


def _clip_grad_by_total_norm_any_device(original: Callable) -> Callable:
    @functools.wraps(original)
    def clip_grad_by_total_norm_fp32(
        parameters: Union[List[torch.Tensor], torch.Tensor],
        max_norm: Union[int, float],
        total_norm: float,
        use_decoupled_grad: bool = False,
    ) -> None:
        """Scale the gradients in place by ``max_norm / (total_norm + 1e-6)`` when that is below 1."""
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0 and grads:
            torch._foreach_mul_(grads, clip_coeff)

    return clip_grad_by_total_norm_fp32


def _shims() -> list[tuple[Any, str, Callable[[], bool], Callable[[Callable], Callable]]]:
    """(owner, attribute, probe saying the CUDA use is there, replacement factory) for every shim."""
    buffer = param_and_grad_buffer._ParamAndGradBuffer
    return [
        (buffer, "__init__", functools.partial(_calls_current_device, buffer, "__init__"), _on_cpu_current_device),
        (mcore_optimizer.FP32Optimizer, "__init__",
         functools.partial(_names_cuda, mcore_optimizer.FP32Optimizer, "__init__"), _with_cuda_factories_on_cpu),
        (clip_grads, "get_grad_norm_fp32", functools.partial(_names_cuda, clip_grads, "get_grad_norm_fp32"),
         _with_cuda_factories_on_cpu),
        (clip_grads, "clip_grad_by_total_norm_fp32",
         functools.partial(_asserts_cuda_grads, clip_grads, "clip_grad_by_total_norm_fp32"),
         _clip_grad_by_total_norm_any_device),
    ]


def apply_cpu_training_shims(device: DeviceLike = None) -> list[str]:
    """Patch megatron-core's DDP buffers, FP32 optimizer and grad clipping to run on the CPU.

    Applied when `device` is the CPU (None: when CUDA is absent), for the rest of the process.
    Idempotent. Returns the qualified names patched by this call.
    """
    if not runs_on_cpu(device):
        return []
    needed = [(owner, name, make) for owner, name, cuda_use_present, make in _shims()
              if not is_patched(owner, name) and cuda_use_present()]
    return [qualified_name(owner, name) for owner, name, make in needed if replace_attribute(owner, name, make)]
