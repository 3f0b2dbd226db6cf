"""Hugging Face Llama-family checkpoints in and out of ``train.model``.

    config, params = train.hf.load_pretrained("Llama-3.2-1B")          # a local HF folder
    logits = Transformer(config).apply({"params": params}, tokens)
    train.hf.save_pretrained("out", config, params)                      # transformers loads it

Supported: ``LlamaForCausalLM`` (Llama 2/3.x, with Llama 3's ``rope_scaling``),
``Qwen2ForCausalLM`` (q/k/v biases) and ``MistralForCausalLM`` (its sliding window is not
applied: exact up to ``sliding_window`` tokens); tied or untied embeddings, grouped-query
attention, any RMSNorm epsilon and RoPE theta. A folder holds ``config.json`` and either
``model.safetensors`` or shards listed in ``model.safetensors.index.json`` (and usually
``tokenizer.json``, which ``config.data.tokenizer`` can point at).

Names and layouts. A Hugging Face linear stores ``weight [out, in]``; ``train.model`` stores
``kernel [in, out]``. The q, k and v projections become one ``attn/qkv`` kernel ``[d, (H + 2
KV) hd]`` (columns q, then k, then v; biases likewise) and gate and up one ``mlp/gate_up``
kernel ``[d, 2 d_ff]`` (gate first), unless ``fused_projections=False``. Layers are stacked on
a leading axis under ``layers`` (``scan_layers=True``) or stored as ``layers_0`` ...  Both
sides use the rotate-half RoPE layout, so q and k need no permutation.

Memory: every parameter is described once as the HF tensor blocks it is made of, and any block
of it is read on its own (``safetensors``' ``get_slice``). Without a mesh the parameters come
back whole in host memory (their size, plus one HF tensor at a time). With ``shardings``
(``load_pretrained(..., shardings=...)``, the trainer's ``--config.init_from``) each process
reads only its devices' blocks, one at a time, straight onto the devices: host memory holds one
device's block of one parameter, never the model.

BitNet models, whose extra norms a Llama checkpoint cannot hold, go out as GGUF instead
(:func:`save_gguf`: llama.cpp's ternary TQ1_0 / TQ2_0 tensors, ``train/gguf_ternary.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import pathlib
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from train import gguf_ternary
from train.model import ModelConfig, projection_paths, rope_frequencies

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Architecture -> the HF config values it implies beyond the common Llama fields.
ARCHITECTURES = {
    "LlamaForCausalLM": {"model_type": "llama"},
    "Qwen2ForCausalLM": {"model_type": "qwen2"},
    "MistralForCausalLM": {"model_type": "mistral"},
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # old Llama checkpoints store RoPE's buffer
QUANT_SCALE_SUFFIX = ".weight_scale"  # quantized exports: "<linear>.weight" int8 [out, in] + this [out]
QUANT_SCHEMES = ("w8a16", "w8a8")


class UnsupportedCheckpointError(ValueError):
  """The folder is not a checkpoint this module reads (architecture, option or file missing)."""


# ---------------------------------------------------------------------------------------------
# Configs.


def model_config_from_hf(hf: Mapping[str, Any], **overrides) -> ModelConfig:
  """The :class:`~train.model.ModelConfig` of a Hugging Face ``config.json`` (as a dict).

  ``overrides`` set the fields HF does not describe (``dtype``, ``recipe``, ``scan_layers`` ...).

  Raises:
    UnsupportedCheckpointError: another architecture, activation, head size or RoPE scaling.
  """
  architecture = (hf.get("architectures") or ["?"])[0]
  if architecture not in ARCHITECTURES:
    raise UnsupportedCheckpointError(
        f"architecture {architecture!r} (model_type {hf.get('model_type')!r}) is not supported; "
        f"train.hf reads {', '.join(ARCHITECTURES)}"
    )
  if hf.get("hidden_act", "silu") != "silu":
    raise UnsupportedCheckpointError(f"hidden_act={hf['hidden_act']!r}: train.model's MLP is SwiGLU (silu)")
  if hf.get("mlp_bias"):
    raise UnsupportedCheckpointError("mlp_bias=True: train.model's MLP has no biases")
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

  The one description of both directions: :func:`_read_block` builds any block of a leaf from it,
  the whole leaf (host arrays) or one device's shard (``load_pretrained(..., shardings=...)``);
  :func:`hf_tensors` cuts the leaves back into HF tensors.
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
# Import.


def read_config(path: str | pathlib.Path) -> dict:
  """The ``config.json`` of a Hugging Face folder (UnsupportedCheckpointError when missing)."""
  file = pathlib.Path(path) / CONFIG_FILE
  if not file.is_file():
    raise UnsupportedCheckpointError(f"{file} not found: not a Hugging Face model folder")
  return json.loads(file.read_text())


def weight_files(path: str | pathlib.Path) -> list[pathlib.Path]:
  """The safetensors files of a folder: ``model.safetensors`` or the shards of its index."""
  folder = pathlib.Path(path)
  index = folder / INDEX_FILE
  if index.is_file():
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    missing = [name for name in shards if not (folder / name).is_file()]
    if missing:
      raise UnsupportedCheckpointError(f"{folder}: shard(s) {', '.join(missing)} listed in {INDEX_FILE} are missing")
    return [folder / name for name in shards]
  if (folder / SINGLE_FILE).is_file():
    return [folder / SINGLE_FILE]
  raise UnsupportedCheckpointError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors are read)")


# An open tensor: (its safe_open file, shape, safetensors dtype such as "BF16" or "I8").
_Tensor = tuple[Any, tuple[int, ...], str]


@contextlib.contextmanager
def _opened(files: list[pathlib.Path]) -> Iterator[dict[str, _Tensor]]:
  """Every tensor of ``files`` by name, the files held open; only their headers are read."""
  from safetensors import safe_open

  with contextlib.ExitStack() as stack:
    tensors = {}
    for file in files:
      f = stack.enter_context(safe_open(str(file), framework="numpy"))
      for name in f.keys():  # noqa: SIM118  (safe_open has no __iter__)
        block = f.get_slice(name)
        tensors[name] = (f, tuple(block.get_shape()), block.get_dtype())
    yield tensors


def _read_slice(file, name: str, index: tuple[slice, ...]) -> np.ndarray:
  """Block ``index`` of tensor ``name`` of an open file; safetensors copies only that block
  (bf16 arrives as ml_dtypes' bfloat16). Every byte of the import is read here."""
  return file.get_slice(name)[index]


def _scale_name(weight: str) -> str:
  """The scale tensor of a quantized export's int8 ``<linear>.weight``."""
  return weight.removesuffix(".weight") + QUANT_SCALE_SUFFIX


def _read(tensors: dict[str, _Tensor], name: str, index: tuple[slice, ...]) -> np.ndarray:
  """Block ``index`` of HF tensor ``name``; a quantized export's int8 weight block (see
  :func:`save_pretrained`) comes out float32 ``codes * scale[rows, None]``."""
  file, _, dtype = tensors[name]
  value = _read_slice(file, name, index)
  if dtype != "I8":
    return value
  scale = _read_slice(tensors[_scale_name(name)][0], _scale_name(name), index[:1])
  return value.astype(np.float32) * scale.astype(np.float32)[:, None]


def _read_block(tensors: dict[str, _Tensor], pieces: list[_Piece], shape: tuple[int, ...], dtype,
                index: tuple[slice, ...]) -> np.ndarray:
  """Block ``index`` of our leaf of ``shape`` made of ``pieces``, reading only what it covers.

  Args:
    tensors: the open checkpoint (:func:`_opened`).
    pieces: the leaf's sources (:func:`_sources`).
    shape, dtype: the leaf's.
    index: a tuple of unit-step slices, one per axis or fewer (``jax.make_array_from_callback``
      passes one device's; all ``slice(None)`` is the whole leaf).

  Returns:
    ``dtype`` array of the block's shape: host memory for one block, plus one HF part at a time.
  """
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  bounds = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
  block = np.empty([stop - start for start, stop in bounds], dtype)
  first, last = bounds[-1]
  for piece in pieces:
    rows, target = bounds, [slice(None)] * len(shape)
    if piece.layer is not None:  # scan_layers: the piece is one row of axis 0
      (start, stop), rows = bounds[0], bounds[1:]
      if not start <= piece.layer < stop:
        continue
      target[0] = piece.layer - start
    begin, end = (piece.columns.start, piece.columns.stop) if piece.columns else (0, shape[-1])
    lo, hi = max(first, begin), min(last, end)
    if lo >= hi:
      continue
    source = [slice(*r) for r in rows[:-1]] + [slice(lo - begin, hi - begin)]
    target[-1] = slice(lo - first, hi - first)
    value = _read(tensors, piece.name, tuple(source[::-1] if piece.transposed else source))
    block[tuple(target)] = value.T if piece.transposed else value  # casts to dtype
  return block


def _on_devices(shape: tuple[int, ...], sharding: jax.sharding.Sharding, read) -> jax.Array:
  """The ``jax.Array`` of ``shape`` on ``sharding`` whose blocks are ``read(index)`` (``index`` a
  tuple of slices), as ``jax.make_array_from_callback`` builds it, with one block in host memory
  at a time: each distinct block of this process's devices is read once and on its devices before
  the next is read (``make_array_from_callback`` keeps every device's block until the end, and
  reads a block again for every device that holds a copy)."""
  where = sharding.addressable_devices_indices_map(shape)
  groups = {}  # block bounds -> (index, its devices)
  for device, index in where.items():
    bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
    groups.setdefault(bounds, (index, []))[1].append(device)
  arrays = {}
  for index, devices in groups.values():
    block = read(index)
    arrays |= {device: jax.device_put(block, device) for device in devices}
    jax.block_until_ready([arrays[device] for device in devices])  # the transfer done, the block can go
  return jax.make_array_from_single_device_arrays(shape, sharding, [arrays[device] for device in where])


def _check_tensors(path, config: ModelConfig, tensors: dict[str, _Tensor], sources: dict[str, list[_Piece]],
                   leaves: dict[str, jax.ShapeDtypeStruct]) -> None:
  """UnsupportedCheckpointError unless ``tensors`` are exactly the ones ``config`` implies, in its
  shapes (from the headers, before any data is read)."""
  weights = {name for name, (_, _, dtype) in tensors.items() if dtype == "I8"}
  scales = {name for name in tensors if name.endswith(QUANT_SCALE_SUFFIX)}
  unpaired = {_scale_name(w) for w in weights} ^ scales
  if unpaired:
    raise UnsupportedCheckpointError(f"int8 weights without scales or scales without weights: {sorted(unpaired)[:3]}")
  expected = {}  # HF name -> its shape in our layout, and whether that is transposed
  for leaf, pieces in sources.items():
    for piece in pieces:
      inner = leaves[leaf].shape[1:] if piece.layer is not None else leaves[leaf].shape
      width = piece.columns.stop - piece.columns.start if piece.columns else inner[-1]
      expected[piece.name] = ((*inner[:-1], width), piece.transposed)
  for name, (_, shape, _) in tensors.items():
    if _IGNORED.match(name) or name in scales:
      continue
    if name not in expected:
      raise UnsupportedCheckpointError(f"{path}: unexpected tensor {name!r} {shape} for {config}")
    ours, transposed = expected[name]
    if shape != (ours[::-1] if transposed else ours):
      raise UnsupportedCheckpointError(f"{path}: tensor {name!r} has shape {shape}; config.json implies {ours}"
                                       + (" (transposed)" if transposed else ""))
    if name in weights and tensors[_scale_name(name)][1] != shape[:1]:
      raise UnsupportedCheckpointError(f"{path}: tensor {_scale_name(name)!r} has shape "
                                       f"{tensors[_scale_name(name)][1]}; its weight implies {shape[:1]}")
  missing = sorted(set(expected) - set(tensors))
  if missing:
    raise UnsupportedCheckpointError(f"{path}: {len(missing)} tensor(s) missing, e.g. {missing[0]!r}")


def load_pretrained(path: str | pathlib.Path, param_dtype=jnp.float32, shardings: Mapping | None = None,
                    **overrides) -> tuple[ModelConfig, dict]:
  """``(ModelConfig, params)`` of a Hugging Face checkpoint folder.

  Args:
    path: a folder with ``config.json`` and safetensors weights (see the module doc).
    param_dtype: dtype of the returned parameters.
    shardings: None: the parameters are numpy arrays in host memory. Else a tree of
      ``jax.sharding.Sharding`` with (at least) the parameters' paths, e.g. an initialized
      model's ``jax.tree.map(lambda x: x.sharding, params)``: each parameter is a ``jax.Array``
      on its sharding, and each block this process's devices hold is read from the files on its
      own and put on them before the next, so host memory holds one device's block of one
      parameter at a time, never a whole model.
    **overrides: :class:`~train.model.ModelConfig` fields HF does not set (``dtype``, ``recipe``,
      ``scan_layers``, ``fused_projections`` ...).

  Returns:
    The config and ``params`` as ``Transformer(config).apply({"params": params}, tokens)`` takes
    them (a BitNet recipe's extra norms are not part of a HF model: initialize the model and
    merge with :func:`merge_into`). A quantized export's int8 weights come back dequantized.

  Raises:
    UnsupportedCheckpointError: an unsupported architecture or option, a missing file or tensor,
      a shape config.json does not imply (checked before any weight is read).
    ValueError: ``shardings`` lacks a parameter's path.
  """
  config = model_config_from_hf(read_config(path), param_dtype=param_dtype, **overrides)
  leaves = traverse_util.flatten_dict(abstract_params(config), sep="/")
  sources = _sources(config)
  placed = traverse_util.flatten_dict(shardings, sep="/") if shardings is not None else None
  if placed is not None and set(leaves) - set(placed):
    raise ValueError(f"load_pretrained: shardings has no {', '.join(sorted(set(leaves) - set(placed)))}")
  params = {}
  with _opened(weight_files(path)) as tensors:
    _check_tensors(path, config, tensors, sources, leaves)
    for leaf, abstract in leaves.items():
      read = functools.partial(_read_block, tensors, sources[leaf], abstract.shape, abstract.dtype)
      if placed is None:
        params[leaf] = read(())
      else:
        params[leaf] = _on_devices(abstract.shape, placed[leaf], read)
  return config, traverse_util.unflatten_dict(params, sep="/")


def abstract_params(config: ModelConfig) -> dict:
  """``jax.ShapeDtypeStruct`` tree of ``Transformer(config)``'s parameters."""
  from train.model import Transformer

  return jax.eval_shape(Transformer(config).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]


def merge_into(params: dict, pretrained: dict, where: str = "") -> list[str]:
  """Replace every leaf of ``params`` that ``pretrained`` has, in place (same paths and shapes),
  by ``jnp.asarray(new, old.dtype)`` (a ``jax.Array`` of that dtype stays as it is, sharding
  included); returns the paths of ``params`` left as they were (e.g. BitNet's extra norms).

  Raises:
    ValueError: a path of ``pretrained`` that ``params`` lacks, or a shape mismatch.
  """
  kept = []
  for key, value in params.items():
    path = f"{where}/{key}" if where else key
    if key not in pretrained:
      kept.append(path)
    elif isinstance(value, dict):
      kept += merge_into(value, pretrained[key], path)
    elif tuple(value.shape) != tuple(pretrained[key].shape):
      raise ValueError(f"merge_into: {path} has shape {tuple(value.shape)}, the pretrained {tuple(pretrained[key].shape)}")
    else:
      params[key] = jnp.asarray(pretrained[key], value.dtype)
  extra = set(pretrained) - set(params)
  if extra:
    raise ValueError(f"merge_into: the model has no {', '.join(sorted(f'{where}/{k}' for k in extra))}")
  return kept


# ---------------------------------------------------------------------------------------------
# Export.


def hf_tensors(config: ModelConfig, params: Mapping) -> Iterator[tuple[str, np.ndarray]]:
  """``(HF name, array)`` of every tensor of ``params`` (the import's :func:`_sources` backwards), in HF's order."""
  leaves = traverse_util.flatten_dict(jax.tree.map(np.asarray, dict(params)), sep="/")
  where = {piece.name: (leaf, piece) for leaf, pieces in _sources(config).items() for piece in pieces}
  for name in _hf_names(config):
    leaf, piece = where[name]
    value = leaves[leaf] if piece.layer is None else leaves[leaf][piece.layer]
    value = value[..., piece.columns] if piece.columns else value
    yield name, np.ascontiguousarray(value.T if piece.transposed else value)


def _stored_tensors(config: ModelConfig, params: Mapping, dtype, scheme: str | None) -> Iterator[tuple[str, np.ndarray]]:
  """What :func:`save_pretrained` writes: every tensor in ``dtype``, projections int8 + scale under ``scheme``."""
  from jaxlowbit_numerics import int8  # noqa: PLC0415

  for name, value in hf_tensors(config, params):
    if scheme is not None and name.startswith("model.layers.") and name.endswith("_proj.weight"):
      q, scale = int8.quantize_int8(jnp.asarray(value, jnp.float32), axis=1)  # [out, in]: one scale per row
      yield name, np.asarray(q)
      yield name[: -len(".weight")] + QUANT_SCALE_SUFFIX, np.asarray(scale).reshape(-1)
    else:
      yield name, value.astype(jnp.dtype(dtype)) if dtype is not None else value


def save_pretrained(
    path: str | pathlib.Path,
    config: ModelConfig,
    params: Mapping,
    architecture: str = "LlamaForCausalLM",
    dtype=None,
    max_shard_bytes: int = 5 * 2**30,
    tokenizer: str | pathlib.Path | None = None,
    scheme: str | None = None,
) -> pathlib.Path:
  """Write ``params`` as a Hugging Face folder ``transformers`` loads (``AutoModelForCausalLM``).

  Args:
    path: the folder (created).
    config, params: the model (``Transformer(config)``'s parameters; no BitNet norms).
    architecture: one of :data:`ARCHITECTURES` (``Qwen2ForCausalLM`` for attention biases).
    dtype: the stored dtype (None: the parameters'; e.g. ``jnp.bfloat16``).
    max_shard_bytes: beyond this, tensors go to several ``model-0000i-of-0000n.safetensors``
      files listed in ``model.safetensors.index.json``.
    tokenizer: a ``tokenizer.json`` to copy alongside.
    scheme: None (floating weights), or ``"w8a16"`` / ``"w8a8"``: every attention and MLP
      projection stored as ``<name>.weight`` int8 ``[out, in]`` plus ``<name>.weight_scale``
      float32 ``[out]`` (``W = weight * weight_scale[:, None]``, symmetric per output channel,
      scale ``amax / 127``: the quantization of ``jaxlowbit.inference``'s schemes and of the INT8
      recipe's forward); the embeddings, norms and LM head keep ``dtype``. config.json gets a
      ``quantization_config`` saying so (``quant_method: "jaxlowbit"``); ``load_pretrained`` reads
      it back. ``transformers`` does not run this format.

  Returns:
    The folder.
  """
  from safetensors.numpy import save_file

  if config.recipe is not None and config.recipe.norm_before_linear and config.bitnet_norms:
    raise ValueError("save_pretrained: a BitNet model's extra norms have no Hugging Face Llama equivalent; "
                     "export it as GGUF instead (save_gguf; python -m train.hf export --scheme tq2_0)")
  if scheme not in (None, *QUANT_SCHEMES):
    raise ValueError(f"save_pretrained: scheme must be None or one of {QUANT_SCHEMES}, got {scheme!r}")
  folder = pathlib.Path(path)
  folder.mkdir(parents=True, exist_ok=True)
  shards, current, size = [], {}, 0
  for name, value in _stored_tensors(config, params, dtype, scheme):
    if current and size + value.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name], size = value, size + value.nbytes
  shards.append(current)
  stored = jnp.dtype(dtype) if dtype is not None else jnp.dtype(np.asarray(jax.tree.leaves(params)[0]).dtype)
  if len(shards) == 1:
    save_file(shards[0], str(folder / SINGLE_FILE), metadata={"format": "pt"})
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file(shard, str(folder / file), metadata={"format": "pt"})
      weight_map.update(dict.fromkeys(shard, file))
    total = sum(v.nbytes for shard in shards for v in shard.values())
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
  hf_json = hf_config(config, architecture, stored.name)
  if scheme is not None:
    hf_json["quantization_config"] = {
        "quant_method": "jaxlowbit", "scheme": scheme, "weights": "int8, symmetric per output channel",
        "layout": "<name>.weight int8 [out, in], <name>.weight_scale float32 [out]; W = weight * weight_scale[:, None]",
        "activations": "int8 per token, dynamic" if scheme == "w8a8" else "16-bit",
        "modules": "self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj",
    }  # fmt: skip
  (folder / CONFIG_FILE).write_text(json.dumps(hf_json, indent=2))
  if tokenizer is not None:
    (folder / "tokenizer.json").write_bytes(pathlib.Path(tokenizer).read_bytes())
  return folder


# ---------------------------------------------------------------------------------------------
# GGUF: a BitNet model's ternary weights in llama.cpp's TQ1_0 / TQ2_0 types.

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
  from jaxlowbit import BitNet  # noqa: PLC0415

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
  from jaxlowbit import inference  # noqa: PLC0415
  from jaxlowbit.interception import LayerFilter  # noqa: PLC0415
  from jaxlowbit_numerics import ternary  # noqa: PLC0415

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


def describe(config: ModelConfig) -> str:
  """One line: the imported model's shape."""
  fields = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "rope_theta", "tie_embeddings")
  return ", ".join(f"{k}={getattr(config, k)}" for k in fields)


__all__ = [
    "ARCHITECTURES",
    "GGUF_ARCHITECTURE",
    "GGUF_FILE",
    "GGUF_SCHEMES",
    "UnsupportedCheckpointError",
    "abstract_params",
    "describe",
    "gguf_tensors",
    "hf_config",
    "hf_tensors",
    "load_pretrained",
    "merge_into",
    "model_config_from_hf",
    "read_config",
    "save_gguf",
    "save_pretrained",
    "weight_files",
]


def main(argv: list[str] | None = None) -> int:
  """``python -m train.hf export --checkpoint RUN_DIR --out DIR``: a run's latest (or ``--step``)
  checkpoint as a Hugging Face folder with the run's tokenizer.json, or (``--scheme tq1_0|tq2_0``,
  BitNet runs) as ``DIR/model.gguf``. A model the format cannot hold: one ``error:`` line, exit 2."""
  import argparse  # noqa: PLC0415

  from train import data, generate  # noqa: PLC0415  (heavy: only for the command line)

  parser = argparse.ArgumentParser(prog="python -m train.hf", description=main.__doc__)
  parser.add_argument("command", choices=["export"])
  parser.add_argument("--checkpoint", required=True, help="a train.main --workdir")
  parser.add_argument("--out", required=True, help="the folder to write")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
  parser.add_argument("--dtype", default="bfloat16",
                      help="stored dtype of high-precision weights (bfloat16, float16, float32)")
  parser.add_argument("--architecture", default="", help="default: init_from's, else LlamaForCausalLM")
  parser.add_argument("--scheme", default=None, choices=(*QUANT_SCHEMES, *GGUF_SCHEMES),
                      help="w8a16|w8a8: int8 projections + scales (save_pretrained); tq1_0|tq2_0: a BitNet run as "
                      "GGUF (save_gguf)")
  args = parser.parse_args(argv)
  config, model_config, params, step = generate.load_run(args.checkpoint, args.step)
  tokenizer = data.tokenizer_for(config.data.get("tokenizer", "byte"))
  tokenizer_json = tokenizer.name if isinstance(tokenizer, data.HFTokenizer) else None
  try:
    if args.scheme in GGUF_SCHEMES:
      written = save_gguf(args.out, model_config, params, args.scheme, jnp.dtype(args.dtype),
                          tokenizer=tokenizer_json or "byte")
      print(f"wrote {written} (step {step}, {GGUF_ARCHITECTURE}, {args.scheme}, {args.dtype})")
      return 0
    architecture = args.architecture
    if not architecture and config.get("init_from"):
      architecture = (read_config(config.init_from).get("architectures") or ["LlamaForCausalLM"])[0]
    folder = save_pretrained(args.out, model_config, params, architecture or "LlamaForCausalLM", jnp.dtype(args.dtype),
                             tokenizer=tokenizer_json, scheme=args.scheme)
  except (ValueError, ImportError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {folder} (step {step}, {architecture or 'LlamaForCausalLM'}, {args.dtype})")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
