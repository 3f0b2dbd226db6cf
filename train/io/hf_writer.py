"""Writing ``train.model``'s parameters as a Hugging Face folder ``transformers`` loads.

    train.hf.save_pretrained("out", config, params)                      # transformers loads it

The tensors are the import's description (``hf_config._sources``) walked backwards. BitNet
models, whose extra norms a Llama checkpoint cannot hold, go out as GGUF instead (``gguf.py``).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxlowbit_numerics import int8
from train.io.hf_config import (
    CONFIG_FILE,
    INDEX_FILE,
    QUANT_SCALE_SUFFIX,
    QUANT_SCHEMES,
    SINGLE_FILE,
    _hf_names,
    _sources,
    hf_config,
)
from train.model import ModelConfig


def hf_tensors(config: ModelConfig, params: Mapping) -> Iterator[tuple[str, np.ndarray]]:
  """``(HF name, array)`` of every tensor of ``params`` (the import's ``_sources`` backwards), in HF's order."""
  leaves = traverse_util.flatten_dict(jax.tree.map(np.asarray, dict(params)), sep="/")
  where = {piece.name: (leaf, piece) for leaf, pieces in _sources(config).items() for piece in pieces}
  for name in _hf_names(config):
    leaf, piece = where[name]
    value = leaves[leaf] if piece.layer is None else leaves[leaf][piece.layer]
    value = value[..., piece.columns] if piece.columns else value
    yield name, np.ascontiguousarray(value.T if piece.transposed else value)


def _stored_tensors(config: ModelConfig, params: Mapping, dtype, scheme: str | None) -> Iterator[tuple[str, np.ndarray]]:
  """What :func:`save_pretrained` writes: every tensor in ``dtype``, projections int8 + scale under ``scheme``."""
  for name, value in hf_tensors(config, params):
    if scheme is not None and name.startswith("model.layers.") and name.endswith("_proj.weight"):
      q, scale = int8.quantize_int8(jnp.asarray(value, jnp.float32), axis=1)  # [out, in]: one scale per row
      yield name, np.asarray(q)
      yield name[: -len(".weight")] + QUANT_SCALE_SUFFIX, np.asarray(scale).reshape(-1)
    else:
      yield name, value.astype(jnp.dtype(dtype)) if dtype is not None else value


# Stored dtypes of an export's floating tensors. A cast to an integer dtype rounds weights of magnitude < 1 to 0
# (issue 31: --dtype int8 wrote every matmul weight as 0): int8 storage is --scheme w8a16 / w8a8, with scales.
EXPORT_DTYPES = ("bfloat16", "float16", "float32")


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
  from safetensors.numpy import save_file  # noqa: PLC0415  (optional dependency: the hf / train extras)

  if config.recipe is not None and config.recipe.norm_before_linear and config.bitnet_norms:
    raise ValueError("save_pretrained: a BitNet model's extra norms have no Hugging Face Llama equivalent; "
                     "export it as GGUF instead (save_gguf; python -m train.hf export --scheme tq2_0)")
  if scheme not in (None, *QUANT_SCHEMES):
    raise ValueError(f"save_pretrained: scheme must be None or one of {QUANT_SCHEMES}, got {scheme!r}")
  if dtype is not None and jnp.dtype(dtype).name not in EXPORT_DTYPES:  # int8 would truncate every weight to 0
    raise ValueError(f"save_pretrained: dtype {jnp.dtype(dtype).name} cannot hold the weights; choose one of "
                     f"{EXPORT_DTYPES} (int8 weights with their scales: scheme='w8a16' or 'w8a8')")
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

__all__ = ["hf_tensors", "save_pretrained"]
