"""BitNet models as Hugging Face ``BitNetForCausalLM`` folders, out and back in.

    save_pretrained("out", config, params)                   # transformers.BitNetForCausalLM loads it
    config, params = load_pretrained("out")                  # fine-tune it with train.main

``BitNetForCausalLM`` (transformers' ``models/bitnet``, model_type ``bitnet``) is the published
BitNet b1.58 graph: the Llama block with ``self_attn.attn_sub_norm`` [d_model] on the attention
output before ``o_proj`` and ``mlp.ffn_sub_norm`` [d_ff] on ``act(gate) * up`` before
``down_proj``, ``hidden_act`` ``relu2`` (BitNet b1.58 2B4T) or ``silu``, rotate-half RoPE (ours,
so no permutation). Our model with ``bitnet_norm_placement="sub"`` is that graph: the sub-norms
are ``attn/out_norm`` and ``mlp/down_norm``.

transformers swaps every linear but ``lm_head`` for a BitNet layer chosen by ``config.json``'s
``quantization_config`` (``quant_method: "bitnet"``):

- ``packed`` (default; Microsoft's own 2B4T layout, ``linear_class: "bitlinear"``,
  ``quantization_mode: "offline"``): ``<linear>.weight`` uint8 ``[out / 4, in]``, code ``c + 1``
  of row ``r + i * out / 4`` in bits ``2i, 2i + 1`` of row ``r``; ``<linear>.weight_scale`` [1] is
  the reciprocal of our absmean scale (transformers divides the output by it). The codes and
  scale are those ``jaxlowbit.inference``'s ternary scheme runs (a fused projection's parts
  share its scale), and transformers quantizes activations to int8 per token as we do, so the
  two forwards differ only by rounding order.
- ``master`` (``linear_class: "autobitlinear"``, ``quantization_mode: "online"``): the float
  master weights; transformers quantizes each linear itself (absmean per tensor). That is our
  forward exactly for a model trained with ``fused_projections=False``; a fused model's q/k/v
  (gate/up) share one scale in our forward and get one each there.

Import (:func:`load_pretrained`) reads both. Packed weights come back as ``codes * s / mean|codes|``
per leaf (fused leaves over their parts): absmean quantization of that gives back exactly the
codes and the scale ``s``, so the imported model computes what the exported one did (plain
``codes * s`` would quantize to the same codes with a scale ``mean|codes|`` times too small).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxlowbit import BitNet, inference
from jaxlowbit.interception import LayerFilter
from jaxlowbit_numerics import ternary
from train.io.hf_config import (
    BITNET_ACTIVATIONS,
    BITNET_ARCHITECTURE,
    CONFIG_FILE,
    SINGLE_FILE,
    UnsupportedCheckpointError,
    _sources,
    model_config_from_hf,
    read_config,
)
from train.io.hf_writer import hf_tensors as llama_tensors
from train.model import ModelConfig, Transformer, projection_paths

ARCHITECTURE = BITNET_ARCHITECTURE
MODEL_TYPE = "bitnet"
FORMATS = ("packed", "master")
QUANTIZATION = {
    "packed": {"quant_method": "bitnet", "linear_class": "bitlinear", "quantization_mode": "offline"},
    "master": {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online"},
}
CODES_PER_BYTE = 4  # transformers' BitLinear: four 2-bit codes per uint8, stacked over rows
SCALE_SUFFIX = ".weight_scale"
ACTIVATIONS = BITNET_ACTIVATIONS


def _is_bitnet(recipe) -> bool:
  return isinstance(recipe, BitNet)


def check(config: ModelConfig) -> None:
  """ValueError unless ``config`` is a model ``BitNetForCausalLM`` holds: every attention and MLP
  projection BitNet, sub-norm placement, no biases, no RoPE scaling, a high-precision LM head."""
  placement = config.bitnet_norm_placement if config.bitnet_norms else "none"
  if placement != "sub":
    raise ValueError(f"BitNetForCausalLM has the two BitNet sub-norms; this model's norms are placed {placement!r}. "
                     "Train with --config.model.bitnet_norm_placement=sub")
  layers = [p for p in projection_paths(config) if p != "lm_head"]
  high = [p for p in layers if not _is_bitnet(config.recipe_for(p))]
  if high:
    raise ValueError(f"BitNetForCausalLM quantizes every attention and MLP linear; {', '.join(high)} run in high "
                     "precision here (filter_fqns, quantize_attention / quantize_mlp)")
  if "lm_head" in projection_paths(config) and config.recipe_for("lm_head") is not None:
    raise ValueError("BitNetForCausalLM keeps lm_head in high precision; this model quantizes it (quantize_lm_head)")
  if config.attention_bias:
    raise ValueError("BitNetForCausalLM: export a model without attention biases")
  if config.rope_scaling:
    raise ValueError("BitNetForCausalLM: RoPE scaling is not written for BitNet exports; train without rope_scaling")
  if config.mlp_activation not in ACTIVATIONS:
    raise ValueError(f"BitNetForCausalLM: hidden_act must be one of {ACTIVATIONS}")
  if (config.n_heads + 2 * config.n_kv_heads) * config.head_dim % CODES_PER_BYTE or config.d_ff % CODES_PER_BYTE:
    raise ValueError("BitNetForCausalLM packs four codes per byte over output rows: n_kv_heads * head_dim, "
                     "d_model and d_ff must be multiples of 4")


def hf_config(config: ModelConfig, weights: str = "packed", torch_dtype: str = "float32",
              bos_id: int | None = None, eos_id: int | None = None) -> dict:
  """The ``config.json`` of ``config`` as a ``BitNetForCausalLM`` (weights ``packed`` or ``master``)."""
  check(config)
  if weights not in FORMATS:
    raise ValueError(f"hf_bitnet: weights must be one of {FORMATS}, got {weights!r}")
  return {
      "architectures": [ARCHITECTURE],
      "model_type": MODEL_TYPE,
      "vocab_size": config.vocab_size,
      "hidden_size": config.d_model,
      "intermediate_size": config.d_ff,
      "num_hidden_layers": config.n_layers,
      "num_attention_heads": config.n_heads,
      "num_key_value_heads": config.n_kv_heads,
      "head_dim": config.head_dim,
      "hidden_act": config.mlp_activation,
      "max_position_embeddings": 8192,
      "rms_norm_eps": config.norm_eps,
      "rope_theta": config.rope_theta,
      "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},  # transformers >= 5
      "attention_bias": False,
      "tie_word_embeddings": config.tie_embeddings,
      "bos_token_id": bos_id,
      "eos_token_id": eos_id,
      "torch_dtype": torch_dtype,
      "dtype": torch_dtype,
      "quantization_config": dict(QUANTIZATION[weights]),
  }


def pack_rows(codes: np.ndarray) -> np.ndarray:
  """transformers' BitLinear layout of ternary ``codes`` int ``[out, in]``: uint8 ``[out / 4, in]``."""
  rows = codes.shape[0] // CODES_PER_BYTE
  shifted = (np.asarray(codes, np.int16) + 1).astype(np.uint8).reshape(CODES_PER_BYTE, rows, -1)
  packed = np.zeros(shifted.shape[1:], np.uint8)
  for i in range(CODES_PER_BYTE):
    packed |= shifted[i] << (2 * i)
  return packed


def unpack_rows(packed: np.ndarray) -> np.ndarray:
  """Inverse of :func:`pack_rows`: int8 codes ``[4 rows, in]``."""
  parts = [((packed >> (2 * i)) & 3).astype(np.int8) - 1 for i in range(CODES_PER_BYTE)]
  return np.concatenate(parts, axis=0)


def _ternary(config: ModelConfig, params: Mapping) -> tuple[dict, dict]:
  """``(params with every BitNet kernel replaced by its codes as float32, {leaf path: scale [layers] or []})``."""
  keep = LayerFilter(fn=lambda path, _: not _is_bitnet(config.recipe_for(path)))
  flat = traverse_util.flatten_dict(inference.quantize_params(dict(params), "ternary", filter_fqns=keep), sep="/")
  codes, scales = {}, {}
  for leaf, value in flat.items():
    module, kind = leaf.rsplit("/", 1)
    if kind == "kernel_packed":
      unpacked = np.asarray(ternary.unpack_2bit(value, axis=-1), np.float32)  # [..., out, in]
      codes[f"{module}/kernel"] = np.swapaxes(unpacked, -1, -2)  # our [..., in, out]
      scales[f"{module}/kernel"] = np.asarray(flat[f"{module}/kernel_scale"], np.float32)
    elif kind != "kernel_scale":
      codes[leaf] = np.asarray(value)
  return traverse_util.unflatten_dict(codes, sep="/"), scales


def _where(config: ModelConfig) -> dict[str, tuple[str, int | None]]:
  """HF tensor name -> (our leaf path, its row on the stacked layer axis or None)."""
  return {piece.name: (leaf, piece.layer) for leaf, pieces in _sources(config).items() for piece in pieces}


def hf_tensors(config: ModelConfig, params: Mapping, weights: str = "packed", dtype=np.float32
               ) -> Iterator[tuple[str, np.ndarray]]:
  """``(HF name, array)`` of every tensor of the ``BitNetForCausalLM`` folder; ``dtype`` for the floating ones."""
  check(config)
  if weights == "master":
    for name, value in llama_tensors(config, params):
      yield name, value.astype(dtype)
    return
  where = _where(config)
  codes, scales = _ternary(config, params)
  for name, value in llama_tensors(config, codes):
    leaf, layer = where[name]
    if leaf in scales:  # a BitNet projection: codes [out, in]
      scale = scales[leaf] if layer is None else scales[leaf][layer]
      yield name, pack_rows(value.astype(np.int8))
      # float32 whatever dtype says: transformers casts it to the dtype the model is loaded in.
      yield name.removesuffix(".weight") + SCALE_SUFFIX, np.reshape(1 / np.float32(scale), (1,))
    else:
      yield name, value.astype(dtype)


def save_pretrained(path: str | pathlib.Path, config: ModelConfig, params: Mapping, weights: str = "packed",
                    dtype=np.float32, tokenizer: str | pathlib.Path | None = None, bos_id: int | None = None,
                    eos_id: int | None = None) -> pathlib.Path:
  """Write ``config``'s BitNet model as a ``BitNetForCausalLM`` folder (``config.json``, ``model.safetensors``,
  the tokenizer.json if given): each file is written in a temporary folder inside ``path`` and renamed
  into place once complete, so a failed export leaves no partial file.

  ``dtype`` is the stored type of the embedding, norms and (master) weights; the packed weights'
  ``weight_scale`` stays float32 (transformers casts it to the dtype it loads the model in).
  """
  from safetensors.numpy import save_file  # noqa: PLC0415  (optional: the hf / train extras)

  config_json = hf_config(config, weights, np.dtype(dtype).name, bos_id, eos_id)
  folder = pathlib.Path(path)
  folder.mkdir(parents=True, exist_ok=True)
  staging = pathlib.Path(tempfile.mkdtemp(prefix=".bitnet.", dir=folder))
  try:
    save_file(dict(hf_tensors(config, params, weights, dtype)), str(staging / SINGLE_FILE), metadata={"format": "pt"})
    (staging / CONFIG_FILE).write_text(json.dumps(config_json, indent=2))
    if tokenizer is not None:
      shutil.copyfile(tokenizer, staging / "tokenizer.json")
    for file in sorted(staging.iterdir()):  # every file complete before it takes its name
      os.replace(file, folder / file.name)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return folder


def is_bitnet(hf_json: Mapping[str, Any]) -> bool:
  """Whether a ``config.json`` is a ``BitNetForCausalLM``."""
  return (hf_json.get("architectures") or [""])[0] == ARCHITECTURE or hf_json.get("model_type") == MODEL_TYPE


def load_pretrained(path: str | pathlib.Path, param_dtype=jnp.float32, shardings: Mapping | None = None,
                    **overrides) -> tuple[ModelConfig, dict]:
  """``(ModelConfig, params)`` of a ``BitNetForCausalLM`` folder (either weight format).

  The config is ``hf_config.model_config_from_hf``'s: the BitNet recipe, sub-norms, its activation,
  q/k/v and gate/up unfused unless ``overrides`` say otherwise. Packed weights come back as
  ``codes * s / mean|codes|`` per leaf (module doc), so the BitNet forward of the result runs the
  folder's codes and scales. The folder is read whole into host memory; with ``shardings`` (a tree
  of ``jax.sharding.Sharding`` with the parameters' paths) each parameter is then put on its own.
  """
  from safetensors.numpy import load_file  # noqa: PLC0415  (optional: the hf / train extras)

  config = model_config_from_hf(read_config(path), param_dtype=param_dtype, **overrides)
  files = sorted(pathlib.Path(path).glob("*.safetensors"))
  if not files:
    raise UnsupportedCheckpointError(f"{path} holds no .safetensors file")
  tensors = {}
  for file in files:
    tensors |= load_file(str(file))
  floats, scales = {}, {}
  for name, value in tensors.items():
    if name.endswith(SCALE_SUFFIX):
      continue
    if value.dtype == np.uint8:
      floats[name] = unpack_rows(value).astype(np.float32)
      scales[name] = 1 / np.float32(np.reshape(tensors[name.removesuffix(".weight") + SCALE_SUFFIX], ()))
    else:
      floats[name] = np.asarray(value, np.float32)
  abstract = traverse_util.flatten_dict(
      jax.eval_shape(Transformer(config).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"], sep="/")
  placed = traverse_util.flatten_dict(shardings, sep="/") if shardings is not None else {}
  params = {}
  for leaf, pieces in _sources(config).items():
    missing = [p.name for p in pieces if p.name not in floats]
    if missing:
      raise UnsupportedCheckpointError(f"{path}: tensor {missing[0]!r} missing")
    block = np.zeros(abstract[leaf].shape, np.float32)
    packed = [p for p in pieces if p.name in scales]
    # One divisor per leaf and layer: the mean |code| over the parts the leaf is made of.
    fraction = {layer: np.mean(np.concatenate([np.abs(floats[p.name]).ravel() for p in packed if p.layer == layer]))
                for layer in {p.layer for p in packed}}  # fmt: skip
    for piece in pieces:
      value = floats.pop(piece.name)
      if piece.name in scales:
        value = value * scales[piece.name] / max(fraction[piece.layer], np.finfo(np.float32).tiny)
      value = value.T if piece.transposed else value
      target = (piece.layer,) if piece.layer is not None else ()
      block[(*target, ..., piece.columns) if piece.columns is not None else target] = value
    block = block.astype(param_dtype)
    params[leaf] = jax.device_put(block, placed[leaf]) if leaf in placed else block
  if floats:
    raise UnsupportedCheckpointError(f"{path}: unexpected tensor(s) {sorted(floats)[:3]} for {config}")
  return config, traverse_util.unflatten_dict(params, sep="/")


__all__ = ["ARCHITECTURE", "FORMATS", "QUANTIZATION", "check", "hf_config", "hf_tensors", "is_bitnet",
           "load_pretrained", "pack_rows", "save_pretrained", "unpack_rows"]
