"""The two conversions: Hugging Face Llama-family safetensors -> Megatron-Core ``torch_dist`` and back.

Owns the checks that a checkpoint matches its config (every tensor present, every shape as the
config implies, nothing left over) and the streaming loop: one Megatron chunk (one layer of one
fused tensor) is assembled from its Hugging Face tensors when the writer asks for it, so memory
stays near the largest tensor. The Megatron checkpoint also carries the architecture record and the
original Hugging Face side files (config, tokenizer) under ``mcp_context/``, which ``mcore_to_hf``
restores. File formats live in ``hf_io`` / ``mcore_io``; names and fusing in ``mapping``.
"""
from __future__ import annotations

import io
import json
import os
import sys
from typing import Any, Optional

import torch

from mcp_context.convert.hf_io import (DEFAULT_MAX_SHARD_BYTES, HFCheckpointReader, HFCheckpointWriter, MissingTensorError,
                                        read_json_object)
from mcp_context.convert.mapping import TensorMap, extra_state_keys, hf_names_at, hf_tensors, slots, tensor_maps
from mcp_context.convert.mcore_io import EXTRA_DIR, McoreCheckpointReader, TensorChunk, save_chunks
from mcp_context.convert.model_config import HFModel, hf_config_from_model, hf_model_from_config
from mcp_context.recipes.schema import ModelConfig

ARCH_RECORD = f"{EXTRA_DIR}/architecture.json"
HF_SIDE_DIR = f"{EXTRA_DIR}/hf"
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "tokenizer.model", "special_tokens_map.json", "vocab.json", "merges.txt",
                 "added_tokens.json", "chat_template.jinja")
# Buffers some older HF checkpoints carry; recomputed from the config, never converted.
_IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)
MCORE_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")


def _progress(total: int, desc: str, enabled: Optional[bool]) -> Any:
    from tqdm.auto import tqdm

    # enabled=None: show the bar only on a terminal
    return tqdm(total=total, desc=desc, unit="tensor", disable=None if enabled is None else not enabled)


def check_hf_tensors(reader: HFCheckpointReader, arch: HFModel) -> None:
    """Raise unless ``reader`` holds exactly the tensors ``arch`` needs, with the shapes it implies."""
    m = arch.shape
    expected = {name: shape for name, shape, _ in hf_tensors(m, arch.model_type)}
    present = set(reader.names())
    missing = [n for n in expected if n not in present]
    if missing:
        raise MissingTensorError(
            f"checkpoint {reader.dir} lacks {len(missing)} tensor(s) a {arch.model_type} with "
            f"num_hidden_layers={m.num_layers} needs, e.g. {missing[:4]}; the checkpoint is incomplete "
            f"or config.json does not describe it")
    for name, shape in expected.items():
        actual = reader.info(name).shape
        if actual != shape:
            raise ValueError(f"tensor {name!r} has shape {list(actual)} but config.json implies {list(shape)} "
                             f"(hidden_size={m.hidden_size}, num_attention_heads={m.num_attention_heads}, "
                             f"num_key_value_heads={m.num_query_groups}, head_dim={m.kv_channels}, "
                             f"intermediate_size={m.ffn_hidden_size}, vocab_size={m.vocab_size}{_moe_sizes(m)}); "
                             f"fix config.json or the weights")
    leftover = sorted(n for n in present - set(expected) if not n.endswith(_IGNORED_HF_SUFFIXES))
    mtp = _mtp_tensors(leftover, reader.config, arch)
    leftover = [n for n in leftover if n not in mtp]
    if m.share_embeddings_and_output_weights and leftover == ["lm_head.weight"]:
        if torch.equal(reader.read("lm_head.weight"), reader.read("model.embed_tokens.weight")):
            leftover = []
        else:
            raise ValueError("config.json has tie_word_embeddings=true but lm_head.weight differs from "
                             "model.embed_tokens.weight; set tie_word_embeddings=false to keep both")
    if leftover:
        raise ValueError(f"checkpoint {reader.dir} has {len(leftover)} tensor(s) a {arch.model_type} does not "
                         f"use, e.g. {leftover[:4]}; converting would drop them (is this really a "
                         f"{arch.model_type}? is qkv bias / tying set correctly in config.json?)")
    if mtp:
        print(f"notice: dropping the {len(mtp)} tensor(s) of DeepSeek-V3's multi-token-prediction layer(s) "
              f"(model.layers.{m.num_layers}.* on; config.json num_nextn_predict_layers="
              f"{reader.config.get('num_nextn_predict_layers')}): the megatron-core model built here has no MTP "
              f"block, so the conversion holds the main model only", file=sys.stderr)


def _mtp_tensors(names: list[str], config: dict, arch: HFModel) -> list[str]:
    """The names among ``names`` that belong to a DeepSeek-V3 checkpoint's multi-token-prediction layers
    (``model.layers.L ..`` up to ``L + num_nextn_predict_layers - 1``, after the ``L`` main layers)."""
    extra = config.get("num_nextn_predict_layers") or 0
    if arch.model_type != "deepseek_v3" or not isinstance(extra, int) or isinstance(extra, bool):
        return []
    prefixes = tuple(f"model.layers.{arch.shape.num_layers + i}." for i in range(extra))
    return [n for n in names if n.startswith(prefixes)]


def _moe_sizes(m: ModelConfig) -> str:
    """The expert count and width a MoE shape's tensor shapes follow, for an error message."""
    if m.num_moe_experts is None:
        return ""
    return f", experts={m.num_moe_experts}, expert intermediate size={m.moe_ffn_hidden_size}"


def _common_dtype(reader: HFCheckpointReader, names: list[str]) -> torch.dtype:
    dtypes = {reader.info(n).dtype for n in names}
    if len(dtypes) != 1:
        raise ValueError(f"tensors {names} have different dtypes {sorted(map(str, dtypes))}; they are fused "
                         f"into one Megatron tensor and must share a dtype")
    return dtypes.pop()


def _hf_chunks(reader: HFCheckpointReader, arch: HFModel) -> list[TensorChunk]:
    chunks = []
    model = arch.shape
    for tmap in tensor_maps(model, arch.model_type):
        global_shape = tmap.global_shape(model)
        for slot in slots(tmap, model):
            names = hf_names_at(tmap, slot)
            dtype = _common_dtype(reader, names)
            offsets = tuple(slot) + (0,) * (len(global_shape) - len(slot))
            sizes = (1,) * len(slot) + global_shape[len(slot):]  # a whole layer's experts where slot is (layer,)

            def load(tmap: TensorMap = tmap, names: list[str] = names, sizes: tuple = sizes) -> torch.Tensor:
                return tmap.fuse([reader.read(n) for n in names]).reshape(sizes)

            chunks.append(TensorChunk(tmap.mcore_key, global_shape, offsets, sizes, dtype, load))
    return chunks


def _extra_state_objects(model: ModelConfig) -> dict[str, bytes]:
    """``_extra_state`` entries megatron-core's loader asks for (``None`` payloads, as a fresh model has)."""
    buf = io.BytesIO()
    torch.save([None], buf)
    return {key: buf.getvalue() for key in extra_state_keys(model)}


def hf_to_mcore(hf_dir: str | os.PathLike, mcore_dir: str | os.PathLike,
                progress: Optional[bool] = None) -> HFModel:
    """Convert a Hugging Face Llama / Mistral / Qwen2 safetensors checkpoint to a megatron-core
    ``torch_dist`` checkpoint (loadable at any TP / PP / CP). Returns the model."""
    reader = HFCheckpointReader(hf_dir)
    arch = hf_model_from_config(reader.config)
    check_hf_tensors(reader, arch)
    chunks = _hf_chunks(reader, arch)
    extra_files = {ARCH_RECORD: json.dumps(arch.to_record(), indent=2).encode()}
    for name in HF_SIDE_FILES:
        if (reader.dir / name).is_file():
            extra_files[f"{HF_SIDE_DIR}/{name}"] = (reader.dir / name).read_bytes()
    with _progress(len(chunks), "hf-to-mcore", progress) as bar:
        save_chunks(mcore_dir, chunks, _extra_state_objects(arch.shape), extra_files, on_written=lambda _: bar.update())
    return arch


def _architecture_of(reader: McoreCheckpointReader, hf_config: Optional[dict]) -> HFModel:
    if hf_config is not None:
        return hf_model_from_config(hf_config)
    record = reader.dir / ARCH_RECORD
    if not record.is_file():
        raise FileNotFoundError(f"{reader.dir} has no {ARCH_RECORD} (it was not written by this converter); "
                                f"pass the Hugging Face config.json of the model (--hf-config)")
    data = read_json_object(record, "the architecture record hf-to-mcore wrote")
    try:
        return HFModel.from_record(data)
    except ValueError as exc:
        raise ValueError(f"{record}: {exc}") from None


def check_mcore_tensors(reader: McoreCheckpointReader, arch: HFModel) -> None:
    """Raise unless ``reader`` holds exactly the model tensors ``arch`` needs, with the right global shapes."""
    maps = tensor_maps(arch.shape, arch.model_type)
    for tmap in maps:
        expected = tmap.global_shape(arch.shape)
        actual = reader.shape(tmap.mcore_key)  # raises MissingTensorError naming the key
        if actual != expected:
            raise ValueError(f"tensor {tmap.mcore_key!r} has global shape {list(actual)} but the architecture "
                             f"implies {list(expected)}; the checkpoint does not match {ARCH_RECORD} / --hf-config")
    known = {m.mcore_key for m in maps}
    leftover = sorted(k for k in reader.keys() if k.startswith(MCORE_MODEL_PREFIXES) and k not in known)
    if leftover:
        raise ValueError(f"checkpoint {reader.dir} has model tensors the {arch.model_type} mapping does not "
                         f"cover, e.g. {leftover[:4]}; converting would drop them")


def read_slot(reader: McoreCheckpointReader, tmap: TensorMap, model: ModelConfig, slot: tuple) -> torch.Tensor:
    """One chunk of ``tmap`` (one layer, one expert of one layer, all experts of one layer, or the
    whole tensor) as stored, without its leading slot axes."""
    if not slot:
        return reader.read(tmap.mcore_key)
    global_shape = tmap.global_shape(model)
    chunk = reader.read(tmap.mcore_key, tuple(slot) + (0,) * (len(global_shape) - len(slot)),
                        (1,) * len(slot) + global_shape[len(slot):])
    return chunk.reshape(global_shape[len(slot):])


def mcore_to_hf(mcore_dir: str | os.PathLike, hf_dir: str | os.PathLike, *,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, hf_config: Optional[dict] = None,
                progress: Optional[bool] = None) -> HFModel:
    """Convert a megatron-core ``torch_dist`` checkpoint (any TP/PP it was saved at) to Hugging Face
    safetensors, bit for bit in the checkpoint's dtype. Returns the model."""
    reader = McoreCheckpointReader(mcore_dir)
    arch = _architecture_of(reader, hf_config)
    check_mcore_tensors(reader, arch)
    maps = tensor_maps(arch.shape, arch.model_type)
    plan = [(name, shape, reader.dtype(tmap.mcore_key))
            for name, shape, tmap in hf_tensors(arch.shape, arch.model_type)]
    with HFCheckpointWriter(hf_dir, plan, max_shard_bytes) as writer, \
            _progress(len(plan), "mcore-to-hf", progress) as bar:
        for tmap in maps:
            for slot in slots(tmap, arch.shape):
                fused = read_slot(reader, tmap, arch.shape, slot)
                for name, tensor in zip(hf_names_at(tmap, slot), tmap.split(fused)):
                    writer.write(name, tensor)
                    bar.update()
                del fused
        for name in HF_SIDE_FILES:
            data = reader.extra_file(f"{HF_SIDE_DIR}/{name}")
            if data is not None:
                writer.add_file(name, data)
        if hf_config is not None or reader.extra_file(f"{HF_SIDE_DIR}/config.json") is None:
            config = hf_config or hf_config_from_model(
                arch, str(reader.dtype("embedding.word_embeddings.weight")).removeprefix("torch."))
            writer.add_file("config.json", json.dumps(config, indent=2).encode())
        writer.finish()
    return arch
