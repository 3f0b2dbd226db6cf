"""A trained model as a GGUF file that llama.cpp loads and runs unchanged.

    file = save_gguf("out", config, params, tokenizer="byte")               # llama.cpp's bitnet or llama
    llama_cpp.Llama(model_path=str(file))                                   # or: llama-cli -m out/model.gguf

Two of llama.cpp's architectures, chosen by how the model was trained (:func:`architecture`):

``bitnet`` (a model whose projections run the BitNet recipe): llama.cpp's graph of BitNet b1.58 as
published: pre-norms ``attn_norm`` / ``ffn_norm``, ``attn_sub_norm`` on the attention output before
``attn_output``, ``ffn_sub_norm`` on the MLP's hidden activation before ``ffn_down``, rotate-half
RoPE, and the output head always ``token_embd`` (tied). So the model must be trained with
``model.bitnet_norm_placement="sub"`` and ``model.tie_embeddings=True``; the MLP activation is
SwiGLU (silu, llama.cpp's default) or squared ReLU (``mlp_activation="relu2"``: written as
``bitnet.hidden_activation = "relu2"``, which only llama.cpp builds that know the name read:
llama-cpp-python 0.3.36 runs such a file with SwiGLU, measured). Every BitNet
weight is stored as its exact ternary codes (TQ2_0, 2.06 bits a weight, or TQ1_0, 1.69 bits; block
scale 1.0) plus its float32 absmean scale as ``<name>.scale`` [1], the tensor llama.cpp's graph
multiplies the projection's output by; so ``codes * scale`` is bit for bit the weight
``jaxlowbit.inference``'s ``ternary`` scheme runs. llama.cpp quantizes the activations to 8 bits
per 256-value block where we quantize per token, which is all that separates the two forwards.
TQ blocks hold 256 values of a row: d_model, n_heads * head_dim and d_ff must be multiples of 256.

``llama`` (every other run: bf16, INT8, FP8): the usual Llama graph. Weights in F32, F16, BF16 or
Q8_0 (32-value blocks, one float16 scale each: rows must be multiples of 32); norms F32. llama.cpp's
``llama`` RoPE rotates adjacent pairs where ours rotates the two halves of a head, so the rows of
``attn_q`` and ``attn_k`` (and their biases) are permuted within each head: row ``2i`` is our
``i``, row ``2i + 1`` our ``i + head_dim / 2``. The weights are the run's master weights; an
INT8-trained run may instead give the weights its forward multiplies (``weights="int8"``: int8 per
output channel, dequantized).

The file carries the tokenizer (``train/io/gguf_tokenizer.py``) so llama.cpp tokenizes a prompt to
the ids ``train.data`` gives. It is written to a temporary file beside the target and renamed,
so a failed export leaves no partial file.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import warnings
from collections.abc import Iterator, Mapping

import jax
import numpy as np
from flax import traverse_util

from jaxlowbit import BitNet, Int8MixedPrecision, inference
from jaxlowbit.interception import LayerFilter
from jaxlowbit_numerics import ternary
from train.io import gguf_ternary, gguf_tokenizer
from train.io.hf_config import _columns
from train.model import ModelConfig, projection_paths, rope_frequencies

GGUF_FILE = "model.gguf"
BITNET, LLAMA = "bitnet", "llama"
TERNARY_QTYPES = gguf_ternary.QTYPES  # ("tq1_0", "tq2_0")
FLOAT_QTYPES = ("f32", "f16", "bf16", "q8_0")
QTYPES = (*TERNARY_QTYPES, *FLOAT_QTYPES)
DEFAULT_QTYPE = {BITNET: "tq2_0", LLAMA: "f16"}
WEIGHT_SOURCES = ("master", "int8")
Q8_0_BLOCK = 32  # values per Q8_0 block (ggml's QK8_0)
DEFAULT_CONTEXT = 8192  # llama.cpp's default n_ctx when the user gives none; RoPE itself has no limit
# A projection (its path in a block) -> llama.cpp's name of each column block of its kernel.
PROJECTIONS = {
    "attn/qkv": ("attn_q", "attn_k", "attn_v"), "attn/q": ("attn_q",), "attn/k": ("attn_k",), "attn/v": ("attn_v",),
    "attn/out": ("attn_output",), "mlp/gate_up": ("ffn_gate", "ffn_up"), "mlp/gate": ("ffn_gate",),
    "mlp/up": ("ffn_up",), "mlp/down": ("ffn_down",),
}  # fmt: skip
_PART = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "ffn_gate": "gate", "ffn_up": "up"}  # a fused kernel's blocks
# Our RMSNorms -> llama.cpp's names. The sub-norms exist only in BitNet models (llama.cpp's bitnet graph).
NORMS = {"attn_norm": "attn_norm", "mlp_norm": "ffn_norm", "attn/out_norm": "attn_sub_norm",
         "mlp/down_norm": "ffn_sub_norm"}  # fmt: skip
_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0",
               "tq1_0": "MOSTLY_TQ1_0", "tq2_0": "MOSTLY_TQ2_0"}  # fmt: skip
PLACEMENT_FLAG = "--config.model.bitnet_norm_placement=sub"
RELU2_NOTE = ("a relu2 BitNet model needs a llama.cpp that reads bitnet.hidden_activation and knows 'relu2'; older "
              "builds (llama-cpp-python 0.3.36 among them) ignore the key and run SwiGLU (silu) instead")


def _is_bitnet(recipe) -> bool:
  return isinstance(recipe, BitNet)


def _is_int8(recipe) -> bool:
  return isinstance(recipe, Int8MixedPrecision)


def ternary_paths(config: ModelConfig) -> list[str]:
  """The projections (``layers.attn.qkv`` ...) that run the BitNet recipe."""
  return [path for path in projection_paths(config) if _is_bitnet(config.recipe_for(path))]


def architecture(config: ModelConfig) -> str:
  """``"bitnet"`` for a model with BitNet projections, else ``"llama"``."""
  return BITNET if ternary_paths(config) else LLAMA


def _placement(config: ModelConfig) -> str:
  """The BitNet norm placement: ``sub``, ``every_projection``, or ``none`` (``bitnet_norms=False``)."""
  if not config.bitnet_norms:
    return "none"
  return config.bitnet_norm_placement


def _activation(config: ModelConfig) -> str:
  return config.mlp_activation


def check(config: ModelConfig, qtype: str | None = None, weights: str = "master") -> tuple[str, str]:
  """``(architecture, qtype)`` of the export, or ValueError saying what the file cannot hold and what to change.

  Checked before any work: a BitNet model's norm placement, tied head, RoPE scaling and biases
  (what llama.cpp's ``bitnet`` graph has), every TQ / Q8_0 row length, the weight source.
  """
  arch = architecture(config)
  qtype = (qtype or DEFAULT_QTYPE[arch]).lower()
  if qtype not in QTYPES:
    raise ValueError(f"save_gguf: qtype must be one of {', '.join(QTYPES)}, got {qtype!r}")
  if weights not in WEIGHT_SOURCES:
    raise ValueError(f"save_gguf: weights must be one of {WEIGHT_SOURCES}, got {weights!r}")
  if arch == BITNET:
    if qtype not in TERNARY_QTYPES:
      raise ValueError(f"save_gguf: a BitNet model goes to llama.cpp's bitnet graph with ternary weights: qtype tq2_0 "
                       f"or tq1_0, not {qtype}")
    if _placement(config) != "sub":
      raise ValueError(f"save_gguf: this BitNet model's norms are placed {_placement(config)!r}; llama.cpp's "
                       "bitnet graph (the published "
                       "BitNet b1.58) has only the two sub-norms before the attention output and down projections. "
                       f"Train with {PLACEMENT_FLAG} to export to llama.cpp")
    if not config.tie_embeddings:
      raise ValueError("save_gguf: llama.cpp's bitnet graph always takes the output head from token_embd, and this "
                       "model has its own lm_head; train with --config.model.tie_embeddings=true")
    if config.rope_scaling:
      raise ValueError("save_gguf: llama.cpp's bitnet graph has no RoPE frequency scaling (rope_freqs); train without "
                       "model.rope_scaling")
    if config.attention_bias:
      raise ValueError("save_gguf: llama.cpp's bitnet graph has no attention biases; train with attention_bias=False")
    for path in ternary_paths(config):
      k = projection_paths(config)[path][0]
      if k % gguf_ternary.BLOCK_VALUES:
        raise ValueError(f"save_gguf: {path} has {k} input features, not a multiple of {qtype}'s "
                         f"{gguf_ternary.BLOCK_VALUES}-value block; GGUF's ternary types need d_model, "
                         "n_heads * head_dim and d_ff divisible by 256 (train such a shape, or keep this model in "
                         "safetensors)")
  else:
    if qtype in TERNARY_QTYPES:
      raise ValueError(f"save_gguf: {qtype} stores BitNet ternary weights, and this model has no BitNet projection "
                       f"(recipe {config.recipe!r}); choose one of {', '.join(FLOAT_QTYPES)}")
    if _activation(config) != "silu":
      raise ValueError(f"save_gguf: llama.cpp's llama graph is SwiGLU (silu); mlp_activation={_activation(config)!r} "
                       "has no llama equivalent")
    if weights == "int8" and not any(_is_int8(config.recipe_for(p)) for p in projection_paths(config)):
      raise ValueError(f"save_gguf: weights='int8' gives an INT8-trained run's forward weights; recipe "
                       f"{config.recipe!r} has none (use weights='master')")
    if qtype == "q8_0":
      widths = {"token_embd": config.d_model, **{p: k for p, (k, _) in projection_paths(config).items()}}
      for name, k in widths.items():
        if k % Q8_0_BLOCK:
          raise ValueError(f"save_gguf: {name} has rows of {k} values, not a multiple of Q8_0's {Q8_0_BLOCK}-value "
                           "block; export as f16 or bf16, or train d_model, n_heads * head_dim and d_ff divisible "
                           "by 32")
  return arch, qtype


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One GGUF tensor before encoding.

  Attributes:
    name: llama.cpp's name (``blk.0.attn_q.weight``).
    value: float32 in GGUF's numpy order (a matrix ``[out, in]``), or int8 ternary codes ``[out, in]``.
    kind: ``"matrix"`` (stored in the file's qtype), ``"ternary"`` (TQ1_0 / TQ2_0) or ``"f32"``.
  """

  name: str
  value: np.ndarray
  kind: str


def _rope_permutation(rows: int, head_dim: int) -> np.ndarray:
  """Row order turning rotate-half q/k rows into llama.cpp's adjacent-pair RoPE: within each head,
  new row ``2i`` is old row ``i`` and ``2i + 1`` is ``i + head_dim / 2``."""
  half = head_dim // 2
  within = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)  # [0, h, 1, h + 1, ...]
  return (np.arange(rows // head_dim)[:, None] * head_dim + within[None]).reshape(-1)


def _layer(tree: Mapping, config: ModelConfig, i: int) -> dict:
  """Block ``i``'s parameters, flattened ``{"attn/qkv/kernel": array}``."""
  block = jax.tree.map(lambda x: x[i], tree["layers"]) if config.scan_layers else tree[f"layers_{i}"]
  return traverse_util.flatten_dict(dict(block), sep="/")


def gguf_tensors(config: ModelConfig, params: Mapping, weights: str = "master") -> Iterator[Tensor]:
  """Every tensor of the GGUF file of ``config``'s architecture, in llama.cpp's names and layouts.

  BitNet projections are their ``jaxlowbit.inference`` ternary codes (``kind="ternary"``) and a
  ``<name>.scale`` float32 [1] (a fused projection's parts share its scale); high-precision
  projections, the embedding and an untied head are float32 matrices; norms and biases float32.
  """
  arch = architecture(config)
  params = dict(params)
  if arch == BITNET:
    keep = LayerFilter(fn=lambda path, _: not _is_bitnet(config.recipe_for(path)))
    converted, scheme = inference.quantize_params(params, "ternary", filter_fqns=keep), "ternary"
  elif weights == "int8":
    keep = LayerFilter(fn=lambda path, _: not _is_int8(config.recipe_for(path)))
    converted, scheme = inference.quantize_params(params, "w8a16", filter_fqns=keep), "w8a16"
  else:
    converted, scheme = params, None
  yield Tensor("token_embd.weight", np.asarray(params["embed"]["embedding"], np.float32), "matrix")
  yield Tensor("output_norm.weight", np.asarray(params["final_norm"]["scale"], np.float32), "f32")
  if not config.tie_embeddings:
    yield Tensor("output.weight", np.asarray(params["lm_head"]["kernel"], np.float32).T, "matrix")
  if config.rope_scaling:  # llama.cpp's Llama 3 convention: per-frequency divisors of the angle
    unscaled = rope_frequencies(config.head_dim, config.rope_theta)
    scaled = rope_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    yield Tensor("rope_freqs.weight", np.asarray(unscaled / scaled, np.float32), "f32")
  permute = {"attn_q": config.n_heads, "attn_k": config.n_kv_heads} if arch == LLAMA else {}
  for i in range(config.n_layers):
    flat, prefix = _layer(converted, config, i), f"blk.{i}."
    for leaf, value in sorted(flat.items()):
      module, kind = leaf.rsplit("/", 1)
      if kind == "scale" and module in NORMS:
        yield Tensor(f"{prefix}{NORMS[module]}.weight", np.asarray(value, np.float32), "f32")
        continue
      if module not in PROJECTIONS:
        raise ValueError(f"save_gguf: parameter layers/{leaf} has no place in llama.cpp's {arch} graph")
      if kind in ("kernel_scale", "smooth"):
        continue  # read with its codes
      if kind == "kernel_packed":
        rows = np.asarray(ternary.unpack_2bit(value, axis=-1))  # codes [out, in]
        ternary_scale = np.float32(flat[f"{module}/kernel_scale"])
      elif kind == "kernel_q":
        rows, ternary_scale = np.asarray(inference.dequantize_weight(_leaves(flat, module), scheme)).T, None
      else:
        rows, ternary_scale = np.asarray(value, np.float32).T, None  # [out, in]; a bias stays [out]
      stems = PROJECTIONS[module]
      for stem in stems:
        part = rows[_columns(config, _PART[stem])] if len(stems) > 1 else rows
        if stem in permute:
          part = part[_rope_permutation(part.shape[0], config.head_dim)]
        if kind == "bias":
          yield Tensor(f"{prefix}{stem}.bias", np.ascontiguousarray(part, np.float32), "f32")
        elif ternary_scale is not None:
          yield Tensor(f"{prefix}{stem}.weight", np.ascontiguousarray(part, np.int8), "ternary")
          yield Tensor(f"{prefix}{stem}.scale", np.reshape(ternary_scale, (1,)), "f32")
        else:
          yield Tensor(f"{prefix}{stem}.weight", np.ascontiguousarray(part, np.float32), "matrix")


def _leaves(flat: Mapping, module: str) -> dict:
  return {leaf.rsplit("/", 1)[1]: value for leaf, value in flat.items() if leaf.rsplit("/", 1)[0] == module}


def _encode(gguf, tensor: Tensor, qtype: str, matrix_qtype: str) -> tuple[np.ndarray, object]:
  """``(data, raw_dtype or None)`` for ``GGUFWriter.add_tensor``."""
  kinds = gguf.GGMLQuantizationType
  if tensor.kind == "f32":
    return tensor.value.astype(np.float32), None
  if tensor.kind == "ternary":
    return gguf_ternary.encode(tensor.value, qtype), kinds[qtype.upper()]
  if matrix_qtype == "f32":
    return tensor.value, None
  if matrix_qtype == "f16":
    return tensor.value.astype(np.float16), None
  return gguf.quants.quantize(tensor.value, kinds[matrix_qtype.upper()]), kinds[matrix_qtype.upper()]


def save_gguf(
    path: str | pathlib.Path,
    config: ModelConfig,
    params: Mapping,
    qtype: str | None = None,
    tokenizer: str | None = "byte",
    name: str = "jaxlowbit",
    weights: str = "master",
    embedding_qtype: str | None = None,
    context_length: int = DEFAULT_CONTEXT,
    pre: str | None = None,
) -> pathlib.Path:
  """Write ``config``'s model as ``<path>/model.gguf`` (or ``path`` itself when it ends in ``.gguf``).

  Args:
    path: a folder (created) or a ``.gguf`` file name.
    config, params: the model (``Transformer(config)``'s parameters, scanned or not).
    qtype: the weights' GGUF type: ``tq2_0`` (BitNet default) or ``tq1_0`` for BitNet models;
      ``f16`` (default), ``bf16``, ``q8_0`` or ``f32`` for the others.
    tokenizer: ``"byte"``, a ``tokenizer.json`` path (``config.data.tokenizer``), or None
      (no ``tokenizer.ggml.*``: llama.cpp will refuse the file; for tensor-only tools).
    name: ``general.name``.
    weights: ``"master"`` or (INT8-trained runs) ``"int8"``: the weights the INT8 forward multiplies.
    embedding_qtype: the embedding's type (None: f16 for BitNet models, else ``qtype``).
    context_length: ``<arch>.context_length`` (llama.cpp's default context).
    pre: llama.cpp's pre-tokenizer name for a tokenizer.json it is not recognised from.

  Returns:
    The file.

  Raises:
    ImportError: the ``gguf`` package is missing.
    ValueError: what the file cannot hold (:func:`check`) or the tokenizer cannot give.
  """
  try:
    import gguf  # noqa: PLC0415  (llama.cpp's gguf-py: the hf / train extras)
  except ImportError as e:
    raise ImportError("save_gguf needs llama.cpp's gguf package: pip install gguf (or the hf / train extras)") from e
  arch, qtype = check(config, qtype, weights)  # before any work
  matrix_qtype = qtype if arch == LLAMA else "f16"
  embedding_qtype = (embedding_qtype or matrix_qtype).lower()
  if embedding_qtype not in FLOAT_QTYPES:
    raise ValueError(f"save_gguf: embedding_qtype must be one of {', '.join(FLOAT_QTYPES)}, got {embedding_qtype!r}")
  vocab = gguf_tokenizer.vocab_for(tokenizer, config.vocab_size, pre) if tokenizer is not None else None
  file = pathlib.Path(path)
  if file.suffix != ".gguf":
    file.mkdir(parents=True, exist_ok=True)
    file = file / GGUF_FILE
  temporary = file.with_name(f".{file.name}.partial")
  try:
    writer = gguf.GGUFWriter(temporary, arch)
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType[_FILE_TYPES[qtype]])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(context_length)
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
    if arch == BITNET and _activation(config) != "silu":
      writer.add_string(f"{arch}.hidden_activation", _activation(config))
      warnings.warn(RELU2_NOTE, stacklevel=2)
    if vocab is not None:
      gguf_tokenizer.add_to(writer, vocab)
    for tensor in gguf_tensors(config, params, weights):
      kind = embedding_qtype if tensor.name == "token_embd.weight" else matrix_qtype
      data, raw = _encode(gguf, tensor, qtype, kind)
      writer.add_tensor(tensor.name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(temporary, file)
  finally:
    temporary.unlink(missing_ok=True)
  return file


__all__ = ["BITNET", "DEFAULT_QTYPE", "FLOAT_QTYPES", "GGUF_FILE", "LLAMA", "QTYPES", "TERNARY_QTYPES", "Tensor",
           "architecture", "check", "gguf_tensors", "save_gguf", "ternary_paths"]
