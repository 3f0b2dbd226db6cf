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

Memory: tensors are read one at a time (``safetensors.safe_open``) and copied into the
preallocated parameter arrays, so loading needs the parameters' size plus one tensor of host
memory, never a second copy of the checkpoint.
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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


def _leaf(params: dict, path: str, layer: int | None, scan: bool) -> tuple[dict, str, tuple]:
  """``(parent dict, leaf name, index)`` of our leaf ``path`` in ``layer`` (index into the stack)."""
  *parents, leaf = path.split("/")
  if layer is None:
    node, index = params, ()
  elif scan:
    node, index = params["layers"], (layer,)
  else:
    node, index = params[f"layers_{layer}"], ()
  for name in parents:
    node = node[name]
  return node, leaf, index


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


def _tensors(files: list[pathlib.Path]) -> Iterator[tuple[str, np.ndarray]]:
  """``(name, array)`` of every tensor, one at a time (bf16 arrives as ml_dtypes' bfloat16)."""
  from safetensors import safe_open

  for file in files:
    with safe_open(str(file), framework="flax") as f:
      for name in f.keys():  # noqa: SIM118  (safe_open has no __iter__)
        yield name, np.asarray(f.get_tensor(name))


def _dequantized(tensors: Iterator[tuple[str, np.ndarray]]) -> Iterator[tuple[str, np.ndarray]]:
  """Pass tensors through; an int8 ``weight`` and its ``weight_scale`` (a quantized export, see
  :func:`save_pretrained`) come out as one float32 ``weight = int8 * scale[:, None]``."""
  codes, scales = {}, {}
  for name, tensor in tensors:
    if name.endswith(QUANT_SCALE_SUFFIX):
      scales[name[: -len(QUANT_SCALE_SUFFIX)] + ".weight"] = tensor
    elif tensor.dtype == np.int8:
      codes[name] = tensor
    else:
      yield name, tensor
    for ready in set(codes) & set(scales):
      yield ready, codes.pop(ready).astype(np.float32) * scales.pop(ready).astype(np.float32)[:, None]
  if codes or scales:
    raise UnsupportedCheckpointError(f"int8 weights without scales or scales without weights: {sorted({*codes, *scales})[:3]}")


def load_pretrained(path: str | pathlib.Path, param_dtype=jnp.float32, **overrides) -> tuple[ModelConfig, dict]:
  """``(ModelConfig, params)`` of a Hugging Face checkpoint folder.

  Args:
    path: a folder with ``config.json`` and safetensors weights (see the module doc).
    param_dtype: dtype of the returned parameters (numpy arrays, host memory).
    **overrides: :class:`~train.model.ModelConfig` fields HF does not set (``dtype``, ``recipe``,
      ``scan_layers``, ``fused_projections`` ...).

  Returns:
    The config and ``params`` as ``Transformer(config).apply({"params": params}, tokens)`` takes
    them (a BitNet recipe's extra norms are not part of a HF model: initialize the model and
    merge with :func:`merge_into`). A quantized export's int8 weights come back dequantized.

  Raises:
    UnsupportedCheckpointError: an unsupported architecture or option, a missing file or tensor.
  """
  config = model_config_from_hf(read_config(path), param_dtype=param_dtype, **overrides)
  names = _hf_names(config)
  params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract_params(config))
  seen = set()
  for name, tensor in _dequantized(_tensors(weight_files(path))):
    if _IGNORED.match(name):
      continue
    if name not in names:
      raise UnsupportedCheckpointError(f"{path}: unexpected tensor {name!r} {tensor.shape} for {config}")
    leaf_path, layer, part = names[name]
    node, leaf, index = _leaf(params, leaf_path, layer, config.scan_layers)
    value = tensor.T if part.startswith("T") else tensor
    target = node[leaf][index]
    columns = _columns(config, part.split(":")[1]) if ":" in part else slice(None)
    if target[..., columns].shape != value.shape:
      raise UnsupportedCheckpointError(
          f"{path}: tensor {name!r} has shape {tensor.shape}; config.json implies {target[..., columns].shape}"
          + (" (transposed)" if part.startswith("T") else "")
      )
    target[..., columns] = value.astype(target.dtype)
    seen.add(name)
  missing = sorted(set(names) - seen)
  if missing:
    raise UnsupportedCheckpointError(f"{path}: {len(missing)} tensor(s) missing, e.g. {missing[0]!r}")
  return config, params


def abstract_params(config: ModelConfig) -> dict:
  """``jax.ShapeDtypeStruct`` tree of ``Transformer(config)``'s parameters."""
  from train.model import Transformer

  return jax.eval_shape(Transformer(config).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"]


def merge_into(params: dict, pretrained: dict, where: str = "", place=None) -> list[str]:
  """Replace every leaf of ``params`` that ``pretrained`` has, in place (same paths and shapes);
  returns the paths of ``params`` left as they were (e.g. BitNet's extra norms).

  ``place(new, old)`` makes the new leaf (default: ``jnp.asarray(new, old.dtype)``; the trainer
  puts each host array straight onto the old leaf's sharding, so no device holds a whole model).

  Raises:
    ValueError: a path of ``pretrained`` that ``params`` lacks, or a shape mismatch.
  """
  place = place or (lambda new, old: jnp.asarray(new, old.dtype))
  kept = []
  for key, value in params.items():
    path = f"{where}/{key}" if where else key
    if key not in pretrained:
      kept.append(path)
    elif isinstance(value, dict):
      kept += merge_into(value, pretrained[key], path, place)
    elif tuple(value.shape) != tuple(pretrained[key].shape):
      raise ValueError(f"merge_into: {path} has shape {tuple(value.shape)}, the pretrained {tuple(pretrained[key].shape)}")
    else:
      params[key] = place(pretrained[key], value)
  extra = set(pretrained) - set(params)
  if extra:
    raise ValueError(f"merge_into: the model has no {', '.join(sorted(f'{where}/{k}' for k in extra))}")
  return kept


# ---------------------------------------------------------------------------------------------
# Export.


def hf_tensors(config: ModelConfig, params: Mapping) -> Iterator[tuple[str, np.ndarray]]:
  """``(HF name, array)`` of every tensor of ``params`` (inverse of the import's mapping)."""
  params = jax.tree.map(np.asarray, dict(params))
  for name, (leaf_path, layer, part) in _hf_names(config).items():
    node, leaf, index = _leaf(params, leaf_path, layer, config.scan_layers)
    value = node[leaf][index]
    if ":" in part:
      value = value[..., _columns(config, part.split(":")[1])]
    yield name, np.ascontiguousarray(value.T if part.startswith("T") else value)


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
                     "export it with train.generate's ternary inference formats instead")
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


def describe(config: ModelConfig) -> str:
  """One line: the imported model's shape."""
  fields = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "rope_theta", "tie_embeddings")
  return ", ".join(f"{k}={getattr(config, k)}" for k in fields)


__all__ = [
    "ARCHITECTURES",
    "UnsupportedCheckpointError",
    "abstract_params",
    "describe",
    "hf_config",
    "hf_tensors",
    "load_pretrained",
    "merge_into",
    "model_config_from_hf",
    "read_config",
    "save_pretrained",
    "weight_files",
]


def main(argv: list[str] | None = None) -> int:
  """``python -m train.hf export --checkpoint RUN_DIR --out DIR``: a run's latest (or ``--step``)
  checkpoint as a Hugging Face folder, with the run's tokenizer.json."""
  import argparse  # noqa: PLC0415

  from train import data, generate  # noqa: PLC0415  (heavy: only for the command line)

  parser = argparse.ArgumentParser(prog="python -m train.hf", description=main.__doc__)
  parser.add_argument("command", choices=["export"])
  parser.add_argument("--checkpoint", required=True, help="a train.main --workdir")
  parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
  parser.add_argument("--dtype", default="bfloat16", help="stored dtype (bfloat16, float16, float32)")
  parser.add_argument("--architecture", default="", help="default: init_from's, else LlamaForCausalLM")
  parser.add_argument("--scheme", default=None, choices=QUANT_SCHEMES, help="int8 projections + scales (see save_pretrained)")
  args = parser.parse_args(argv)
  config, model_config, params, step = generate.load_run(args.checkpoint, args.step)
  architecture = args.architecture
  if not architecture and config.get("init_from"):
    architecture = (read_config(config.init_from).get("architectures") or ["LlamaForCausalLM"])[0]
  tokenizer = data.tokenizer_for(config.data.get("tokenizer", "byte"))
  folder = save_pretrained(args.out, model_config, params, architecture or "LlamaForCausalLM", jnp.dtype(args.dtype),
                           tokenizer=tokenizer.name if isinstance(tokenizer, data.HFTokenizer) else None,
                           scheme=args.scheme)
  print(f"wrote {folder} (step {step}, {architecture or 'LlamaForCausalLM'}, {args.dtype})")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
