"""GGUF export: a BitNet-trained model's ternary weights in llama.cpp's TQ1_0 / TQ2_0 types.

    train.hf.save_gguf("out", config, params, "tq2_0")                   # out/model.gguf

The block layouts are in ``gguf_ternary.py``; what the file's graph computes and how it differs
from llama.cpp's ``bitnet``: ``docs/finetune.md``.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxlowbit import BitNet, inference
from jaxlowbit.interception import LayerFilter
from jaxlowbit_numerics import ternary
from train.io import gguf_ternary
from train.io.hf_config import _columns, hf_config
from train.model import ModelConfig, projection_paths, rope_frequencies

GGUF_FILE = "model.gguf"
GGUF_SCHEMES = gguf_ternary.QTYPES
# Not llama.cpp's "bitnet": that graph has no norm between attn_norm and q/k/v (nor between
# ffn_norm and gate/up), where this model has one (docs/finetune.md, "BitNet to GGUF").
GGUF_ARCHITECTURE = "jaxlowbit-bitnet"
# A projection (its path in a block, or the LM head) -> llama.cpp's name of each column block.
_GGUF_PROJECTIONS = {
    "attn/qkv": ("attn_q", "attn_k", "attn_v"), "attn/q": ("attn_q",), "attn/k": ("attn_k",), "attn/v": ("attn_v",),
    "attn/out": ("attn_output",), "mlp/gate_up": ("ffn_gate", "ffn_up"), "mlp/gate": ("ffn_gate",),
    "mlp/up": ("ffn_up",), "mlp/down": ("ffn_down",), "lm_head": ("output",),
}  # fmt: skip
_GGUF_FLOAT_TYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # high-precision tensors' dtypes
_GGUF_COLUMNS = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "ffn_gate": "gate", "ffn_up": "up"}  # fused splits
# RMSNorms: llama.cpp's bitnet names where its graph has the norm; the norms BitNet surgery puts
# before q/k/v, gate/up or the LM head are "<projection>_in_norm" (llama.cpp has none there).
_GGUF_NORMS = {
    "attn_norm": "attn_norm", "mlp_norm": "ffn_norm", "attn/out_norm": "attn_sub_norm", "mlp/down_norm": "ffn_sub_norm",
    "attn/qkv_norm": "attn_qkv_in_norm", "attn/q_norm": "attn_q_in_norm", "attn/k_norm": "attn_k_in_norm",
    "attn/v_norm": "attn_v_in_norm", "mlp/gate_up_norm": "ffn_gate_up_in_norm", "mlp/gate_norm": "ffn_gate_in_norm",
    "mlp/up_norm": "ffn_up_in_norm", "final_norm": "output_norm", "lm_head_norm": "output_in_norm",
}  # fmt: skip


# What the file's graph computes beyond the tensors (GGUF metadata, for a reader that implements it).
GGUF_GRAPH_NOTES = {
    "jaxlowbit.graph": (
        "llama.cpp's bitnet block with an RMSNorm (<projection>_in_norm) between attn_norm and q/k/v and "
        "between ffn_norm and gate/up; SwiGLU (silu); rotate-half RoPE (NEOX); LM head 'output' unless tied"),
    "jaxlowbit.weights": (
        "W = codes * <name>.scale: TQ blocks hold the ternary codes with block scale 1.0; the float32 absmean "
        "scale is one per trained matrix (q/k/v and gate/up share their fused projection's)"),
    "jaxlowbit.activations": (
        "int8 per token before every ternary matmul: scale = max(absmax, 1e-5) * float32(1/127), "
        "codes = clip(round_half_even(x / scale), -127, 127)"),
}  # fmt: skip


def _is_bitnet(recipe) -> bool:
  return isinstance(recipe, BitNet)


def _check_gguf(config: ModelConfig, scheme: str) -> None:
  """ValueError unless GGUF's ternary ``scheme`` can store the model (BitNet projections, 256-multiple widths)."""
  if scheme not in GGUF_SCHEMES:
    raise ValueError(f"save_gguf: scheme must be one of {GGUF_SCHEMES}, got {scheme!r}")
  ternary = [path for path in projection_paths(config) if _is_bitnet(config.recipe_for(path))]
  if not ternary:
    raise ValueError(f"save_gguf: {scheme} stores BitNet ternary weights, and this model has no BitNet projection "
                     f"(recipe {config.recipe!r}); export it with save_pretrained (--scheme w8a16, w8a8 or none)")
  for path in ternary:
    k = projection_paths(config)[path][0]
    if k % gguf_ternary.BLOCK_VALUES:
      raise ValueError(f"save_gguf: {path} has {k} input features, not a multiple of {scheme}'s "
                       f"{gguf_ternary.BLOCK_VALUES}-value block; GGUF's ternary types need d_model, "
                       "n_heads * head_dim and d_ff divisible by 256 (train such a shape, or keep this model in "
                       "safetensors)")


def gguf_tensors(config: ModelConfig, params: Mapping, scheme: str = "tq2_0",
                 dtype=None) -> Iterator[tuple[str, np.ndarray, str]]:
  """``(name, array, ggml type name)`` of every tensor :func:`save_gguf` writes.

  BitNet projections come from :func:`jaxlowbit.inference.quantize_params` (scheme ``ternary``:
  the codes and absmean scale ``jaxlowbit.inference`` runs): their codes ``[out, in]`` as
  ``scheme`` block bytes (uint8 ``[out, in / 256 * bytes per block]``, every block scale 1.0)
  plus the float32 scale ``[1]`` as ``<name minus .weight>.scale``; a fused projection's parts
  share its scale. Other floating tensors are ``[out, in]`` (projections) or as stored, in
  ``dtype`` (None: float32) for the embedding and high-precision projections, float32 for
  norms, biases and scales.
  """
  _check_gguf(config, scheme)
  wide = jnp.dtype(dtype or jnp.float32)
  if wide.name not in _GGUF_FLOAT_TYPES:
    raise ValueError(f"save_gguf: dtype must be one of {', '.join(_GGUF_FLOAT_TYPES)}, got {wide.name}")
  wide_type = _GGUF_FLOAT_TYPES[wide.name]
  keep = LayerFilter(fn=lambda path, _: not _is_bitnet(config.recipe_for(path)))
  qparams = inference.quantize_params(dict(params), "ternary", filter_fqns=keep)

  def tensors(tree: Mapping, prefix: str) -> Iterator[tuple[str, np.ndarray, str]]:
    flat = traverse_util.flatten_dict(dict(tree), sep="/")
    for leaf, value in sorted(flat.items()):
      module, kind = leaf.rsplit("/", 1)
      if kind == "scale" and module in _GGUF_NORMS:
        yield f"{prefix}{_GGUF_NORMS[module]}.weight", np.asarray(value, np.float32), "F32"
        continue
      if module == "embed" and kind == "embedding":
        yield "token_embd.weight", np.asarray(value, wide), wide_type
        continue
      if module not in _GGUF_PROJECTIONS or kind not in ("kernel", "bias", "kernel_packed", "kernel_scale"):
        raise ValueError(f"save_gguf: no GGUF name for parameter {prefix}{leaf}")
      if kind == "kernel_scale":
        continue  # written with its codes
      if kind == "kernel_packed":
        rows = np.asarray(ternary.unpack_2bit(jnp.asarray(value), axis=-1))  # codes [out, in]
        scale = np.asarray(flat[f"{module}/kernel_scale"], np.float32).reshape(1)
      else:
        rows = np.asarray(value, np.float32 if kind == "bias" else wide).T  # [out, in] (a bias stays [out])
      for stem in _GGUF_PROJECTIONS[module]:
        part = rows[_columns(config, _GGUF_COLUMNS[stem])] if len(_GGUF_PROJECTIONS[module]) > 1 else rows
        name = f"{prefix}{stem}"
        if kind == "bias":
          yield f"{name}.bias", np.ascontiguousarray(part), "F32"
        elif kind == "kernel":
          yield f"{name}.weight", np.ascontiguousarray(part), wide_type
        else:
          yield f"{name}.weight", gguf_ternary.encode(part, scheme), scheme.upper()
          yield f"{name}.scale", scale, "F32"

  top = {key: value for key, value in qparams.items() if not key.startswith("layers")}
  yield from tensors(top, "")
  if config.rope_scaling:  # llama.cpp's Llama 3 convention: per-frequency divisors of the angle
    unscaled = rope_frequencies(config.head_dim, config.rope_theta)
    scaled = rope_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    yield "rope_freqs.weight", np.asarray(unscaled / scaled, np.float32), "F32"
  for i in range(config.n_layers):
    stacked = config.scan_layers
    layer = jax.tree.map(lambda x, i=i: x[i], qparams["layers"]) if stacked else qparams[f"layers_{i}"]
    yield from tensors(layer, f"blk.{i}.")


def save_gguf(
    path: str | pathlib.Path,
    config: ModelConfig,
    params: Mapping,
    scheme: str = "tq2_0",
    dtype=None,
    tokenizer: str | pathlib.Path | None = None,
    name: str = "jaxlowbit BitNet",
) -> pathlib.Path:
  """Write a BitNet-trained model as ``<path>/model.gguf`` with ternary ``scheme`` tensors.

  Args:
    path: the folder (created).
    config, params: a model whose projections run the BitNet recipe (``Transformer(config)``'s
      parameters, scanned or not); every BitNet projection's input width must be a multiple of 256.
    scheme: ``"tq2_0"`` (2 bits per weight, 66 bytes per 256) or ``"tq1_0"`` (1.6875 bits, 54 bytes).
    dtype: the embedding's and any high-precision projection's type: float32 (None), float16 or
      bfloat16. Norms, biases and the ternary scales are float32.
    tokenizer: a ``tokenizer.json`` (stored whole under ``tokenizer.huggingface.json``), ``"byte"``
      (noted as ``jaxlowbit.tokenizer``) or None.
    name: ``general.name``.

  The tensors are :func:`gguf_tensors`: llama.cpp's names (its ``bitnet`` architecture's where it
  has them) under architecture :data:`GGUF_ARCHITECTURE`, every BitNet weight as its exact
  ternary codes with block scale 1.0 and its float32 absmean scale beside it (``<name>.scale``,
  the scale tensor llama.cpp's bitnet graph multiplies a projection's output by), so
  ``codes * scale`` is bit for bit the weight ``jaxlowbit.inference``'s ``ternary`` scheme runs.
  What the graph is and how it differs from llama.cpp's ``bitnet``: ``docs/finetune.md``.

  Returns:
    The file.

  Raises:
    ImportError: the ``gguf`` package is missing.
    ValueError: no BitNet projection, or a width GGUF's blocks do not divide.
  """
  try:
    import gguf  # noqa: PLC0415  (llama.cpp's gguf-py: the hf / train extras)
  except ImportError as e:
    raise ImportError("save_gguf needs llama.cpp's gguf package: pip install gguf (or the hf / train extras)") from e
  _check_gguf(config, scheme)  # before any work
  folder = pathlib.Path(path)
  folder.mkdir(parents=True, exist_ok=True)
  file = folder / GGUF_FILE
  writer = gguf.GGUFWriter(file, GGUF_ARCHITECTURE)
  writer.add_name(name)
  writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{scheme.upper()}"])
  writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
  writer.add_vocab_size(config.vocab_size)
  writer.add_context_length(hf_config(config)["max_position_embeddings"])
  writer.add_embedding_length(config.d_model)
  writer.add_block_count(config.n_layers)
  writer.add_feed_forward_length(config.d_ff)
  writer.add_head_count(config.n_heads)
  writer.add_head_count_kv(config.n_kv_heads)
  writer.add_key_length(config.head_dim)
  writer.add_value_length(config.head_dim)
  writer.add_rope_dimension_count(config.head_dim)
  writer.add_rope_freq_base(config.rope_theta)
  writer.add_layer_norm_rms_eps(config.norm_eps)
  for key, value in GGUF_GRAPH_NOTES.items():
    writer.add_string(key, value)
  if tokenizer == "byte":
    writer.add_string("jaxlowbit.tokenizer", "byte: ids 0-255 are UTF-8 bytes, 256 BOS, 257 EOS, 258 PAD")
  elif tokenizer is not None:
    writer.add_string(gguf.Keys.Tokenizer.HF_JSON, pathlib.Path(tokenizer).read_text())
  for tensor_name, value, kind in gguf_tensors(config, params, scheme, dtype):
    if kind == "BF16":
      writer.add_tensor(tensor_name, gguf.quants.quantize(value.astype(np.float32), gguf.GGMLQuantizationType.BF16),
                        raw_dtype=gguf.GGMLQuantizationType.BF16)
    elif kind.startswith("TQ"):
      writer.add_tensor(tensor_name, value, raw_dtype=gguf.GGMLQuantizationType[kind])
    else:
      writer.add_tensor(tensor_name, value)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return file

__all__ = ["GGUF_ARCHITECTURE", "GGUF_FILE", "GGUF_GRAPH_NOTES", "GGUF_SCHEMES", "gguf_tensors", "save_gguf"]
