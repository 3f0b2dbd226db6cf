"""Hugging Face ``config.json`` <-> :class:`~train.model.ModelConfig`, and where each HF tensor lands in ours.

Supported: ``LlamaForCausalLM`` (Llama 2/3.x, with Llama 3's ``rope_scaling``),
``Qwen2ForCausalLM`` (q/k/v biases) and ``MistralForCausalLM`` (its sliding window is not
applied: exact up to ``sliding_window`` tokens); tied or untied embeddings, grouped-query
attention, any RMSNorm epsilon and RoPE theta. ``BitNetForCausalLM`` (BitNet b1.58: the Llama
names plus ``self_attn.attn_sub_norm`` and ``mlp.ffn_sub_norm``, our ``attn/out_norm`` and
``mlp/down_norm`` under ``bitnet_norm_placement="sub"``) maps to a BitNet-recipe model here; its
packed weights are read and written by ``hf_bitnet.py``.

Names and layouts. A Hugging Face linear stores ``weight [out, in]``; ``train.model`` stores
``kernel [in, out]``. The q, k and v projections become one ``attn/qkv`` kernel ``[d, (H + 2
KV) hd]`` (columns q, then k, then v; biases likewise) and gate and up one ``mlp/gate_up``
kernel ``[d, 2 d_ff]`` (gate first), unless ``fused_projections=False``. Layers are stacked on
a leading axis under ``layers`` (``scan_layers=True``) or stored as ``layers_0`` ...  Both
sides use the rotate-half RoPE layout, so q and k need no permutation. :func:`_sources` is the
one description of that mapping; the reader (``hf_reader.py``) and the writer (``hf_writer.py``)
both walk it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping
from typing import Any

from jaxlowbit import BitNet
from train.model import ModelConfig

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Architecture -> the HF config values it implies beyond the common Llama fields.
ARCHITECTURES = {
    "LlamaForCausalLM": {"model_type": "llama"},
    "Qwen2ForCausalLM": {"model_type": "qwen2"},
    "MistralForCausalLM": {"model_type": "mistral"},
}
BITNET_ARCHITECTURE = "BitNetForCausalLM"  # model_type "bitnet" (hf_bitnet.py)
BITNET_ACTIVATIONS = ("silu", "relu2")  # hidden_act of BitNetForCausalLM that train.model's MLP has
QUANT_SCALE_SUFFIX = ".weight_scale"  # quantized exports: "<linear>.weight" int8 [out, in] + this [out]
QUANT_SCHEMES = ("w8a16", "w8a8")


class UnsupportedCheckpointError(ValueError):
  """The folder is not a checkpoint ``train.hf`` reads (architecture, option or file missing)."""


# ---------------------------------------------------------------------------------------------
# Configs.


# The sizes every Llama-family config.json must give (as integers >= 1).
HF_REQUIRED_INTS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")


def model_config_from_hf(hf: Mapping[str, Any], **overrides) -> ModelConfig:
  """The :class:`~train.model.ModelConfig` of a Hugging Face ``config.json`` (as a dict).

  ``overrides`` set the fields HF does not describe (``dtype``, ``recipe``, ``scan_layers`` ...).

  Raises:
    UnsupportedCheckpointError: another architecture, activation, head size or RoPE scaling.
  """
  architecture = (hf.get("architectures") or ["?"])[0]
  bitnet = architecture == BITNET_ARCHITECTURE
  if architecture not in ARCHITECTURES and not bitnet:
    raise UnsupportedCheckpointError(
        f"architecture {architecture!r} (model_type {hf.get('model_type')!r}) is not supported; "
        f"train.hf reads {', '.join([*ARCHITECTURES, BITNET_ARCHITECTURE])}"
    )
  activation = hf.get("hidden_act", "silu")
  if activation not in (BITNET_ACTIVATIONS if bitnet else ("silu",)):
    raise UnsupportedCheckpointError(f"hidden_act={activation!r}: train.model's MLP is SwiGLU (silu)"
                                     + (" or squared ReLU (relu2)" if bitnet else ""))
  if hf.get("mlp_bias"):
    raise UnsupportedCheckpointError("mlp_bias=True: train.model's MLP has no biases")
  for key in HF_REQUIRED_INTS:  # a missing or zero size would fail later as a KeyError or a division by zero
    value = hf.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise UnsupportedCheckpointError(f"config.json: {key} must be an integer >= 1, got {value!r}")
  d, heads = hf["hidden_size"], hf["num_attention_heads"]
  if hf.get("head_dim") not in (None, d // heads):
    raise UnsupportedCheckpointError(f"head_dim={hf['head_dim']} != hidden_size / num_attention_heads = {d // heads}")
  bias = architecture == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False))
  # transformers >= 5 writes RoPE's settings as one "rope_parameters" dict; older configs as
  # top-level "rope_theta" and "rope_scaling".
  rope = hf.get("rope_parameters") or {}
  theta = hf.get("rope_theta", rope.get("rope_theta", 10_000.0))
  scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
  fields = dict(
      vocab_size=hf["vocab_size"],
      d_model=d,
      n_layers=hf["num_hidden_layers"],
      n_heads=heads,
      n_kv_heads=hf.get("num_key_value_heads") or heads,
      d_ff=hf["intermediate_size"],
      rope_theta=float(theta),
      rope_scaling=_rope_scaling(scaling),
      attention_bias=bias,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
  )
  if bitnet:  # transformers' BitNet linears: one absmean scale each, so q/k/v and gate/up unfused
    method = (hf.get("quantization_config") or {}).get("quant_method", "bitnet")
    if method != "bitnet":
      raise UnsupportedCheckpointError(f"BitNetForCausalLM quantized with {method!r}: only 'bitnet' is read")
    fields.update(recipe=BitNet(), bitnet_norm_placement="sub", mlp_activation=activation, fused_projections=False)
  return ModelConfig(**{**fields, **overrides})


def _rope_scaling(scaling: Mapping[str, Any] | None) -> tuple[float, ...]:
  if not scaling:
    return ()
  kind = scaling.get("rope_type", scaling.get("type"))
  if kind == "default":
    return ()
  if kind != "llama3":
    raise UnsupportedCheckpointError(f"rope_scaling of type {kind!r} is not supported (only 'llama3')")
  keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
  return tuple(float(scaling[key]) for key in keys)


def hf_config(config: ModelConfig, architecture: str = "LlamaForCausalLM", torch_dtype: str = "float32") -> dict:
  """The Hugging Face ``config.json`` of ``config`` (inverse of :func:`model_config_from_hf`)."""
  if architecture not in ARCHITECTURES:
    raise ValueError(f"hf_config: architecture must be one of {sorted(ARCHITECTURES)}, got {architecture!r}")
  if config.attention_bias and architecture == "MistralForCausalLM":
    raise ValueError("hf_config: Mistral has no attention biases; export as LlamaForCausalLM or Qwen2ForCausalLM")
  out = {
      "architectures": [architecture],
      **ARCHITECTURES[architecture],
      "vocab_size": config.vocab_size,
      "hidden_size": config.d_model,
      "num_hidden_layers": config.n_layers,
      "num_attention_heads": config.n_heads,
      "num_key_value_heads": config.n_kv_heads,
      "head_dim": config.head_dim,
      "intermediate_size": config.d_ff,
      "hidden_act": "silu",
      "rms_norm_eps": config.norm_eps,
      "rope_theta": config.rope_theta,
      "tie_word_embeddings": config.tie_embeddings,
      "max_position_embeddings": 131072 if config.rope_scaling else 8192,
      "torch_dtype": torch_dtype,
  }
  if architecture == "LlamaForCausalLM":
    out.update(attention_bias=config.attention_bias, mlp_bias=False)
  if config.rope_scaling:
    factor, low, high, original = config.rope_scaling
    out["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                           "high_freq_factor": high, "original_max_position_embeddings": int(original)}
  return out


# ---------------------------------------------------------------------------------------------
# Parameter names: HF name -> (our path, layer or None, how).


def _hf_names(config: ModelConfig) -> dict[str, tuple[str, int | None, str]]:
  """Every HF tensor name of ``config`` -> ``(our leaf path inside a layer or the model, layer, part)``.

  ``part`` says how the tensor lands in our leaf: ``"copy"``, ``"T"`` (transposed kernel), or
  ``"T:q"``, ``"T:k"``... a column block of a fused kernel (``"b:q"`` for a bias).
  """
  names = {"model.embed_tokens.weight": ("embed/embedding", None, "copy"), "model.norm.weight": ("final_norm/scale", None, "copy")}
  if not config.tie_embeddings:
    names["lm_head.weight"] = ("lm_head/kernel", None, "T")
  fused = config.fused_projections
  # BitNetForCausalLM's sub-norms: ours under bitnet_norm_placement="sub".
  sub_norms = config.bitnet_norm_placement == "sub" and config.norm_before("layers.mlp.down")
  for i in range(config.n_layers):
    prefix = f"model.layers.{i}."
    names[prefix + "input_layernorm.weight"] = ("attn_norm/scale", i, "copy")
    names[prefix + "post_attention_layernorm.weight"] = ("mlp_norm/scale", i, "copy")
    for x in "qkv":
      names[prefix + f"self_attn.{x}_proj.weight"] = ("attn/qkv/kernel", i, f"T:{x}") if fused else (f"attn/{x}/kernel", i, "T")
      if config.attention_bias:
        names[prefix + f"self_attn.{x}_proj.bias"] = ("attn/qkv/bias", i, f"b:{x}") if fused else (f"attn/{x}/bias", i, "copy")
    names[prefix + "self_attn.o_proj.weight"] = ("attn/out/kernel", i, "T")
    for x in ("gate", "up"):
      names[prefix + f"mlp.{x}_proj.weight"] = ("mlp/gate_up/kernel", i, f"T:{x}") if fused else (f"mlp/{x}/kernel", i, "T")
    names[prefix + "mlp.down_proj.weight"] = ("mlp/down/kernel", i, "T")
    if sub_norms:
      names[prefix + "self_attn.attn_sub_norm.weight"] = ("attn/out_norm/scale", i, "copy")
      names[prefix + "mlp.ffn_sub_norm.weight"] = ("mlp/down_norm/scale", i, "copy")
  return names


def _columns(config: ModelConfig, part: str) -> slice:
  """The columns of a fused kernel (or bias) that ``part`` (``q``, ``k``, ``v``, ``gate``, ``up``) fills."""
  q, kv, ff = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim, config.d_ff
  return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv),
          "gate": slice(0, ff), "up": slice(ff, 2 * ff)}[part]


@dataclasses.dataclass(frozen=True)
class _Piece:
  """Where one HF tensor lands in one of our leaves.

  Attributes:
    name: the HF tensor (a linear's ``weight [out, in]``, a bias ``[out]``, a norm ``[d]``...).
    layer: its row on our leaf's stacked axis 0 (``scan_layers=True``), or None.
    columns: the block of our leaf's last axis it fills (a fused kernel's or bias's part), or None: all of it.
    transposed: HF ``[out, in]`` is our ``[in, out]``.
  """

  name: str
  layer: int | None
  columns: slice | None
  transposed: bool


def _sources(config: ModelConfig) -> dict[str, list[_Piece]]:
  """Each of our leaves (its path, ``"layers/attn/qkv/kernel"``) -> the HF tensors it is made of.

  The one description of both directions: ``hf_reader._read_block`` builds any block of a leaf from it,
  the whole leaf (host arrays) or one device's shard (``load_pretrained(..., shardings=...)``);
  ``hf_writer.hf_tensors`` cuts the leaves back into HF tensors.
  """
  sources = {}
  for name, (path, layer, part) in _hf_names(config).items():
    if layer is not None:
      path = f"layers/{path}" if config.scan_layers else f"layers_{layer}/{path}"
    columns = _columns(config, part.split(":")[1]) if ":" in part else None
    row = layer if config.scan_layers else None
    sources.setdefault(path, []).append(_Piece(name, row, columns, part.startswith("T")))
  return sources


# ---------------------------------------------------------------------------------------------
# A folder's config.json.


def read_config(path: str | pathlib.Path) -> dict:
  """The ``config.json`` of a Hugging Face folder (UnsupportedCheckpointError when missing)."""
  file = pathlib.Path(path) / CONFIG_FILE
  if not file.is_file():
    raise UnsupportedCheckpointError(f"{file} not found: not a Hugging Face model folder")
  try:
    config = json.loads(file.read_text())
  except (ValueError, UnicodeDecodeError) as e:
    raise UnsupportedCheckpointError(f"{file}: not valid JSON ({e})") from None
  if not isinstance(config, dict):
    raise UnsupportedCheckpointError(f"{file}: holds a JSON {type(config).__name__}, not an object")
  return config


def describe(config: ModelConfig) -> str:
  """One line: the imported model's shape."""
  fields = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "rope_theta", "tie_embeddings")
  return ", ".join(f"{k}={getattr(config, k)}" for k in fields)


__all__ = [
    "ARCHITECTURES", "BITNET_ACTIVATIONS", "BITNET_ARCHITECTURE", "CONFIG_FILE", "INDEX_FILE", "QUANT_SCALE_SUFFIX",
    "QUANT_SCHEMES", "SINGLE_FILE",
    "UnsupportedCheckpointError", "describe", "hf_config", "model_config_from_hf", "read_config",
]
