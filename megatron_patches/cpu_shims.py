"""CPU shims: the hard-coded CUDA uses that stop a megatron-core GPTModel from running on the CPU.

Targets megatron-core 0.16.x (seen on 0.16.1). `apply_cpu_shims(device)` patches when the run is on
the CPU (``device="cpu"``; with no device, when CUDA is absent), also on a machine that has CUDA,
each behind a probe that the CUDA use is still there (so a release that fixed one is left alone).
Once applied, megatron-core places its tensors on the CPU for the rest of the process:

- functions that place tensors with ``torch.cuda.current_device()`` — RoPE's `inv_freq` move in
  `RotaryEmbedding.get_emb` and `YarnRotaryEmbedding.get_emb` (MLA), both RoPE constructors (MLA
  builds them without ``use_cpu_initialization``), the MoE router's `gating`, the global memory buffer (`GlobalMemoryBuffer.get_tensor`), the
  sequence-parallel all-gather / reduce-scatter helpers in `tensor_parallel.mappings`, and the
  reduce-scatter buffer in the tensor-parallel linear backward — run with ``current_device()``
  answering the CPU device for the duration of the call (the original code runs unchanged);
- `get_default_causal_mask` and `get_sliding_window_causal_mask` (``device="cuda"``) and
  `get_pos_emb_on_this_cp_rank` (``pin_memory=True`` and ``.cuda()``, hit with CP > 1 and RoPE)
  are replaced by versions that build the same tensors on the CPU / on the input's device;
- the RNG tracker (`CudaRNGStatesTracker.add` / `.fork`, `_get_cuda_rng_state`,
  `_set_cuda_rng_state`) keeps and forks states of the CPU generator, and
  `model_parallel_cuda_manual_seed` seeds the CPU generator as it seeds the CUDA one on a GPU, so
  dropout is deterministic and activation recomputation replays the same masks.

Not covered (not reached by a GPTModel's training forward/backward): inference KV caches, CUDA
graphs, MoE all-to-all, `distribute_saved_activations`, the stock attention with CP > 1 (mcp_context
replaces the core attention). See docs/megatron_patches.md.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from typing import Any, Callable, Iterator, Optional, Union

import torch
from megatron.core import utils as mcore_utils
from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.transformer.moe import router as moe_router
from megatron.core.tensor_parallel import mappings as tp_mappings
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer import utils as transformer_utils

from megatron_patches._patching import is_patched, qualified_name, replace_attribute, run_inside

# (owner, attribute): functions that call torch.cuda.current_device() to place a tensor.
_CURRENT_DEVICE_USERS: tuple[tuple[Any, str], ...] = (
    (rotary_pos_embedding.RotaryEmbedding, "get_emb"),
    (rotary_pos_embedding.RotaryEmbedding, "__init__"),  # MLA builds it without use_cpu_initialization
    (yarn_rotary_pos_embedding.YarnRotaryEmbedding, "__init__"),
    (yarn_rotary_pos_embedding.YarnRotaryEmbedding, "get_emb"),  # MLA's YaRN RoPE (DeepSeek-V3)
    (moe_router.Router, "gating"),  # moves a CPU router weight to current_device() on every call
    (moe_router.TopKRouter, "__init__"),  # expert-bias buffers (DeepSeek-V3's aux-loss-free routing)
    (mcore_utils.GlobalMemoryBuffer, "get_tensor"),
    (tp_mappings, "_gather_along_first_dim"),
    (tp_mappings, "_gather_along_last_dim"),
    (tp_mappings, "_reduce_scatter_along_first_dim"),
    (tp_layers.LinearWithGradAccumulationAndAsyncCommunication, "backward"),
)

_CPU = torch.device("cpu")
DeviceLike = Union[str, torch.device, None]
_redirect_lock = threading.Lock()
_redirect_depth = 0
_cuda_current_device: Optional[Callable[[], Any]] = None


def runs_on_cpu(device: DeviceLike = None) -> bool:
    """Whether megatron-core is to run on the CPU: `device` is a CPU device, or None and CUDA is absent."""
    if device is None:
        return not torch.cuda.is_available()
    try:
        return torch.device(device).type == "cpu"
    except RuntimeError as err:
        raise ValueError(f"device={device!r} is not a torch device; pass 'cpu', 'cuda' or None") from err


def _cpu_device() -> torch.device:
    return _CPU


@contextlib.contextmanager
def _current_device_is_cpu() -> Iterator[None]:
    """Inside the block, ``torch.cuda.current_device()`` returns the CPU device (re-entrant)."""
    global _redirect_depth, _cuda_current_device
    with _redirect_lock:
        if _redirect_depth == 0:
            _cuda_current_device = torch.cuda.current_device
            torch.cuda.current_device = _cpu_device
        _redirect_depth += 1
    try:
        yield
    finally:
        with _redirect_lock:
            _redirect_depth -= 1
            if _redirect_depth == 0:
                torch.cuda.current_device = _cuda_current_device


def _calls_current_device(owner: Any, name: str) -> bool:
    """Probe: does the code of `owner.name` (if it exists) call ``torch.cuda.current_device``?"""
    function = getattr(owner, name, None)
    code = getattr(inspect.unwrap(function), "__code__", None) if callable(function) else None
    return code is not None and "current_device" in code.co_names


_on_cpu_current_device = run_inside(_current_device_is_cpu)


def default_causal_mask_on_cpu(sq: int) -> torch.Tensor:
    """`get_default_causal_mask` on the CPU: [sq, sq] bool, True above the diagonal (masked)."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def sliding_window_causal_mask_on_cpu(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    """`get_sliding_window_causal_mask` on the CPU: [sq, skv] bool, True where masked.

    Query i (aligned to the end of the keys) sees keys j with
    ``i + skv - sq - window_size[0] <= j <= i + skv - sq + window_size[1]``.
    """
    ones = torch.ones(sq, skv, dtype=torch.bool)
    lowest_key = torch.triu(ones, diagonal=skv - sq - window_size[0])
    inside = torch.tril(lowest_key, diagonal=skv - sq + window_size[1])
    return ~inside


def pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """`get_pos_emb_on_this_cp_rank` without pinned memory: the two zigzag chunks of this CP rank.

    `pos_emb` holds the full sequence along `seq_dim`, cut into 2·cp chunks; CP rank r keeps chunks
    r and 2·cp−1−r (Megatron's load-balanced layout), concatenated along `seq_dim`.
    """
    if cp_group is None:
        raise ValueError("cp_group=None: get_pos_emb_on_this_cp_rank needs the context-parallel group")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    if pos_emb.shape[seq_dim] % (2 * cp_size):
        raise ValueError(
            f"pos_emb has {pos_emb.shape[seq_dim]} positions along seq_dim={seq_dim}, not a multiple of "
            f"2*cp_size={2 * cp_size}; pad the sequence to a multiple of {2 * cp_size}"
        )
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1 :])
    mine = chunks.index_select(seq_dim, cp_idx)
    return mine.view(*mine.shape[:seq_dim], -1, *mine.shape[seq_dim + 2 :])


class _SingleRankGroup:
    """A stand-in process group of one rank, for probing functions that only ask size and rank."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _leaves_the_cpu(probe: Callable[[], torch.Tensor]) -> bool:
    """Probe: does `probe()` fail (no CUDA here) or return a tensor off the CPU (CUDA here)?"""
    try:
        result = probe()
    except (AssertionError, RuntimeError):
        return True
    return result.device.type != "cpu"


def _rng_tracker_keeps_cuda_states() -> bool:
    """Probe: does `CudaRNGStatesTracker.add` fail, or track something other than a CPU generator state?"""
    tracker = tp_random.CudaRNGStatesTracker()
    try:
        tracker.add("megatron_patches_probe", 0)
    except (AssertionError, RuntimeError):
        return True
    return not torch.equal(tracker.states_["megatron_patches_probe"], torch.Generator().manual_seed(0).get_state())


def _rng_tracker_add_on_cpu(original: Callable) -> Callable:
    @functools.wraps(original)
    def add(self: Any, name: str, seed: int) -> None:
        """Track a CPU generator state seeded with `seed` under `name`."""
        if self.use_cudagraphable_rng:
            raise ValueError(
                "use_cudagraphable_rng=True needs CUDA graphs; on a CPU-only machine call "
                "model_parallel_cuda_manual_seed(..., use_cudagraphable_rng=False)"
            )
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"RNG tracker seed={seed} is already used; give each state its own seed")
        if name in self.states_:
            raise ValueError(f"RNG tracker state name={name!r} already exists; reset the tracker first")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    return add


def _rng_tracker_fork_on_cpu(original: Callable) -> Callable:
    default_name = tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME

    @contextlib.contextmanager
    def fork(self: Any, name: str = default_name) -> Iterator[None]:
        """Run the block with the CPU generator set to the tracked state `name`, then restore it."""
        if name not in self.states_:
            raise ValueError(
                f"RNG tracker state name={name!r} was never added; call "
                "tensor_parallel.model_parallel_cuda_manual_seed(seed) after initialize_model_parallel"
            )
        outer_state = torch.get_rng_state()
        outer_name = self._current_state_name
        if outer_name != "default-rng":
            self.states_[outer_name] = outer_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise RuntimeError(
                    f"RNG tracker state {self._current_state_name!r} is active at the end of "
                    f"fork({name!r}); forks must nest"
                )
            self.states_[name] = torch.get_rng_state()
            if outer_name != "default-rng":
                outer_state = self.states_[outer_name]
            torch.set_rng_state(outer_state)
            self._current_state_name = outer_name

    return fork


def _get_rng_state_on_cpu(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        """The CPU generator's state (it stands in for the device generator)."""
        if graph_safe:
            raise ValueError("graph_safe=True needs CUDA graphs; not available on a CPU-only machine")
        return torch.get_rng_state()

    return get_rng_state


def _set_rng_state_on_cpu(original: Callable) -> Callable:
    @functools.wraps(original)
    def set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        """Set the CPU generator's state (it stands in for the device generator)."""
        if graph_safe:
            raise ValueError("graph_safe=True needs CUDA graphs; not available on a CPU-only machine")
        torch.set_rng_state(new_state)

    return set_rng_state


def _manual_seed_seeds_cpu(original: Callable) -> Callable:
    @functools.wraps(original)
    def model_parallel_cuda_manual_seed(seed: int, *args: Any, **kwargs: Any) -> None:
        original(seed, *args, **kwargs)
        # On a GPU this function seeds the device generator with `seed` (the data-parallel state);
        # here the CPU generator is the device generator.
        torch.manual_seed(seed)

    return model_parallel_cuda_manual_seed


def _replacing(replacement: Callable) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        return functools.wraps(original)(replacement)

    return make


def _shims() -> list[tuple[Any, str, Callable[[], bool], Callable[[Callable], Callable]]]:
    """(owner, attribute, probe saying the CUDA use is there, replacement factory) for every shim."""
    shims: list[tuple[Any, str, Callable[[], bool], Callable[[Callable], Callable]]] = [
        (owner, name, functools.partial(_calls_current_device, owner, name), _on_cpu_current_device)
        for owner, name in _CURRENT_DEVICE_USERS
    ]
    shims += [
        (transformer_utils, "get_default_causal_mask",
         lambda: _leaves_the_cpu(lambda: transformer_utils.get_default_causal_mask(2)),
         _replacing(default_causal_mask_on_cpu)),
        (transformer_utils, "get_sliding_window_causal_mask",
         lambda: _leaves_the_cpu(lambda: transformer_utils.get_sliding_window_causal_mask(2, 2, (1, 0))),
         _replacing(sliding_window_causal_mask_on_cpu)),
        (rope_utils, "get_pos_emb_on_this_cp_rank",
         lambda: _leaves_the_cpu(
             lambda: rope_utils.get_pos_emb_on_this_cp_rank(torch.zeros(2, 1, 1, 1), 0, _SingleRankGroup())),
         _replacing(pos_emb_on_this_cp_rank)),
    ]
    rng_on_cuda = _rng_tracker_keeps_cuda_states
    shims += [
        (tp_random.CudaRNGStatesTracker, "add", rng_on_cuda, _rng_tracker_add_on_cpu),
        (tp_random.CudaRNGStatesTracker, "fork", rng_on_cuda, _rng_tracker_fork_on_cpu),
        (tp_random, "_get_cuda_rng_state", rng_on_cuda, _get_rng_state_on_cpu),
        (tp_random, "_set_cuda_rng_state", rng_on_cuda, _set_rng_state_on_cpu),
        (tp_random, "model_parallel_cuda_manual_seed", rng_on_cuda, _manual_seed_seeds_cpu),
    ]
    return shims


def apply_cpu_shims(device: DeviceLike = None) -> list[str]:
    """Patch megatron-core's CUDA-only code paths to run on the CPU when `device` is the CPU.

    `device=None` means the CPU exactly when CUDA is absent; a test or run that means the CPU on a
    machine with CUDA passes ``device="cpu"``. The patches hold for the rest of the process.
    Idempotent. Returns the qualified names patched by this call (empty when already applied, when
    the run is not on the CPU, or when the installed megatron-core has none of the CUDA uses).
    """
    if not runs_on_cpu(device):
        return []
    # Probe everything before patching anything: a patched function no longer shows its CUDA use.
    needed = [(owner, name, make) for owner, name, cuda_use_present, make in _shims()
              if not is_patched(owner, name) and cuda_use_present()]
    return [qualified_name(owner, name) for owner, name, make in needed
            if replace_attribute(owner, name, make)]
