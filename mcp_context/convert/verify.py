"""Logit parity between a Hugging Face checkpoint and its Megatron-Core conversion.

Owns checking that the two sides hold the same model (every tensor present with the shape the HF
config implies, on both sides), loading each side for inference in fp32 on one process (the
Megatron side built from the model shape through the ``TransformerConfig`` / ``GPTModel``
translation pretraining uses, and loaded through megatron-core's own ``dist_checkpointing.load``,
as training would load it, with ``safe_pickle``'s load strategies), comparing their logits on one
prompt and, when they differ, naming the tensors that differ. Both models, their inputs and the
reference logits live on one device the caller names (``--device``, default the CPU): a model on
``cuda:0`` fed CPU token ids fails. The Megatron side may be a conversion or a training
checkpoint (its optimizer state, RNG and scheduler entries are not read). It does not convert
anything (``converter``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import types
from typing import Any, Iterator, Optional, Union

import torch

from mcp_context.convert.converter import check_hf_tensors, check_mcore_tensors, read_slot
from mcp_context.convert.hf_io import HFCheckpointReader, MissingTensorError
from mcp_context.convert.mapping import hf_names_at, slots, tensor_maps
from mcp_context.convert.mcore_io import McoreCheckpointReader
from mcp_context.convert.model_config import HFModel
from mcp_context.recipes.schema import (ModelConfig, decoder_spec, gpt_model_kwargs, layer_spec_kwargs,
                                        set_yarn_attributes, transformer_config_class, transformer_config_kwargs)


DeviceLike = Union[str, torch.device]


def verify_device(device: DeviceLike) -> torch.device:
    """``device`` as a ``torch.device`` verify can run on (the CPU or a CUDA device present here), else a
    ``ValueError`` naming ``--device``, the value and the fix."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r} is not a torch device; pass cpu, cuda or cuda:N") from None
    if parsed.type == "cpu":
        return parsed
    if parsed.type != "cuda":
        raise ValueError(f"--device {device!r}: verify runs on cpu or cuda, not {parsed.type}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"--device {device!r} but this torch sees no CUDA device; pass --device cpu")
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(f"--device {device!r} but this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return parsed


@contextlib.contextmanager
def single_process_megatron(seed: int = 0, device: DeviceLike = "cpu") -> Iterator[None]:
    """Megatron parallel state for one process (TP = PP = CP = 1), set up only where absent and torn
    down on exit, with ``megatron_patches`` applied as pretraining applies them. Off CUDA (``device``
    the CPU, or ``meta``) megatron-core's CUDA-only helpers are shimmed onto the CPU; on a CUDA device
    that device becomes the current one, where megatron-core places what it creates itself."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    import megatron_patches

    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    megatron_patches.apply_all(device="cuda" if device.type == "cuda" else "cpu")  # e.g. the MoE router without TE
    own_group = not dist.is_initialized()
    with tempfile.TemporaryDirectory(prefix="mcp_verify_") as tmp:
        if own_group:
            dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=0, world_size=1)
        own_state = not parallel_state.model_parallel_is_initialized()
        if own_state:
            parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(seed)
        try:
            yield
        finally:
            if own_state:
                parallel_state.destroy_model_parallel()
            if own_group:
                dist.destroy_process_group()


def build_gpt_model(model: ModelConfig, layer_spec: Any = None, device: DeviceLike = "cpu",
                    initialize: bool = True, **layout: Any) -> torch.nn.Module:
    """A megatron-core ``GPTModel`` for ``model``: this rank's pipeline stage on the current parallel
    state, every parameter, buffer and RoPE frequency on ``device``.

    ``layer_spec`` (a spec, or a function of the ``TransformerConfig`` giving one, e.g.
    ``lambda config: decoder_spec(model, config)``) defaults to megatron-core's local spec with the layer
    structure the model needs (q/k norms, local experts; ``layer_spec_kwargs``, as pretraining picks it), or
    ours (HCP attention, ``decoder_spec``) for a model with attention sinks or MLA, which megatron-core's own
    local attention cannot build here, or with dense layers among MoE ones (a block of per-layer specs);
    ``layout`` replaces
    ``ModelConfig`` fields (``tensor_model_parallel_size``, ``context_parallel_size``,
    ``cp_comm_type``, ``pipeline_model_parallel_size``, ...) or sets ``TransformerConfig`` fields the
    shape does not hold (``expert_model_parallel_size``), which must agree with the initialised
    parallel state. On CUDA the weights are made on that device; elsewhere on the CPU, then moved (to
    ``meta``: dropped). ``initialize=False`` leaves them uninitialised, for a caller that loads them all.
    """
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    shape_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model = dataclasses.replace(model, **{k: v for k, v in layout.items() if k in shape_fields})
    device = torch.device(device)
    config = transformer_config_class(model)(**transformer_config_kwargs(model),
                                             use_cpu_initialization=device.type != "cuda",
                                             perform_initialization=initialize,
                                             **{k: v for k, v in layout.items() if k not in shape_fields})
    set_yarn_attributes(config, model)
    if isinstance(layer_spec, types.FunctionType):  # a function of the config, e.g. a block of per-layer specs
        layer_spec = layer_spec(config)
    if layer_spec is None and (model.softmax_type != "vanilla" or model.multi_latent_attention or
                               (model.num_moe_experts is not None and model.moe_layer_freq != 1)):
        # megatron-core's own attention makes its softmax_offset on CUDA only and takes no MLA head dims
        # (k_channels / v_channels): ours runs both on any device; dense layers among MoE ones: our block spec
        layer_spec = decoder_spec(model, config)
    elif layer_spec is None:
        structure = layer_spec_kwargs(model)
        layer_spec = get_gpt_layer_local_spec(num_experts=structure["num_experts"],
                                              qk_layernorm=structure["qk_layernorm"],
                                              multi_latent_attention=structure["multi_latent_attention"],
                                              normalization=structure["normalization"])
    # megatron-core makes CUDA weights on the current device: make it the requested one for the build
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        gpt = GPTModel(config, layer_spec, pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True),
                       post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True),
                       **gpt_model_kwargs(model, model.vocab_size))
    gpt.to(device)
    for module in gpt.modules():  # RoPE's frequencies are plain attributes, which Module.to does not move
        if isinstance(module, RotaryEmbedding):
            for name in ("inv_freq", "inv_freq_extra", "inv_freq_inter"):  # the last two: YaRN's
                if hasattr(module, name):
                    setattr(module, name, getattr(module, name).to(device))
    return gpt


def load_mcore_model(mcore_dir: str | os.PathLike, model: ModelConfig, layer_spec: Any = None,
                     device: DeviceLike = "cpu", **layout: Any) -> torch.nn.Module:
    """Build the ``GPTModel`` for ``model`` on ``device`` and the current parallel state, and load
    ``mcore_dir`` into it with megatron-core's ``dist_checkpointing.load`` (through ``safe_pickle``'s
    strategies, which run no code from the checkpoint). Only the model's own entries are taken: a
    training checkpoint's common state (optimizer groups, scheduler, step, layout) comes back from
    ``load`` too. Every entry of the model's state dict is loaded (``load_state_dict`` is strict), so
    the build skips random initialisation."""
    from megatron.core import dist_checkpointing

    from mcp_context.safe_pickle import mcore_load_strategies

    gpt = build_gpt_model(model, layer_spec, device, initialize=False, **layout)
    sharded = gpt.sharded_state_dict()
    sharded_strategy, common_strategy = mcore_load_strategies()
    state = dist_checkpointing.load(sharded, str(mcore_dir), sharded_strategy=sharded_strategy,
                                    common_strategy=common_strategy)
    gpt.load_state_dict({key: state[key] for key in sharded})
    return gpt.eval()


def causal_mask(seq_len: int, device: DeviceLike = "cpu") -> torch.Tensor:
    """Megatron's boolean attention mask ``[1, 1, s, s]`` (True = masked) for causal attention."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def mcore_logits(model: torch.nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
    """``token_ids: [b, s]`` -> logits ``[b, s, vocab]`` of a CP = 1 megatron ``GPTModel``, on the
    model's device (token ids, positions and mask are made or moved there)."""
    device = _model_device(model)
    b, s = token_ids.shape
    position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, s)
    return model(token_ids.to(device), position_ids, causal_mask(s, device)).float()


def load_hf_model(hf_dir: str | os.PathLike, device: DeviceLike = "cpu") -> torch.nn.Module:
    """The Hugging Face model in ``hf_dir`` in fp32 with eager attention, on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    return model.to(device).eval()


@torch.no_grad()
def hf_logits(model: torch.nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[b, s, vocab]`` of a Hugging Face causal LM, on the model's device."""
    return model(token_ids.to(_model_device(model))).logits.float()


def prompt_token_ids(hf_dir: str | os.PathLike, prompt: Optional[str], vocab_size: int,
                     length: int = 32, seed: int = 0) -> torch.Tensor:
    """``[1, s]`` token ids: ``prompt`` through the checkpoint's tokenizer, or ``length`` seeded random ids."""
    if prompt is None:
        return torch.randint(0, vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_dir))(prompt, return_tensors="pt").input_ids


def max_logit_difference(hf_dir: str | os.PathLike, mcore_dir: str | os.PathLike, model: ModelConfig,
                         token_ids: torch.Tensor, device: DeviceLike = "cpu") -> float:
    """Largest absolute difference between the two sides' logits on ``token_ids``, both computed on
    ``device`` (the HF model is freed before the Megatron side is built)."""
    hf_model = load_hf_model(hf_dir, device)
    reference = hf_logits(hf_model, token_ids)
    del hf_model
    with single_process_megatron(device=device):
        ours = mcore_logits(load_mcore_model(mcore_dir, model, device=device), token_ids)
    return (ours - reference).abs().max().item()


def check_same_model(hf: HFCheckpointReader, mcore: McoreCheckpointReader, arch: HFModel) -> None:
    """Raise a ``ValueError`` naming the tensor unless both checkpoints hold exactly the tensors of
    ``arch`` (the HF config's model) with its shapes."""
    for check, reader in ((check_hf_tensors, hf), (check_mcore_tensors, mcore)):
        try:
            check(reader, arch)
        except (MissingTensorError, ValueError) as exc:
            raise ValueError(f"--hf {hf.dir} and --mcore {mcore.dir} do not hold the same model: {exc}") from None


def differing_tensors(hf: HFCheckpointReader, mcore: McoreCheckpointReader, arch: HFModel) -> list[str]:
    """HF names of the tensors whose dtype or bits differ between the two sides (one chunk at a time),
    in checkpoint order: the first is the first mismatching tensor."""
    differ = []
    model = arch.shape
    for tmap in tensor_maps(model, arch.model_type):
        for slot in slots(tmap, model):
            fused = read_slot(mcore, tmap, model, slot)
            for name, ours in zip(hf_names_at(tmap, slot), tmap.split(fused)):
                theirs = hf.read(name)
                if ours.dtype != theirs.dtype or not torch.equal(ours, theirs):
                    differ.append(name)
    return differ
