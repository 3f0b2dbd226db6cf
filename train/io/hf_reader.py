"""Reading a Hugging Face Llama-family folder into ``train.model``'s parameters, on the host or sharded.

    config, params = train.hf.load_pretrained("Llama-3.2-1B")          # a local HF folder
    logits = Transformer(config).apply({"params": params}, tokens)

A folder holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` (and usually ``tokenizer.json``, which ``config.data.tokenizer``
can point at). Which architectures and how names and layouts map: ``hf_config.py``.

Memory: every parameter is described once as the HF tensor blocks it is made of, and any block
of it is read on its own (``safetensors``' ``get_slice``). Without a mesh the parameters come
back whole in host memory (their size, plus one HF tensor at a time). With ``shardings``
(``load_pretrained(..., shardings=...)``, the trainer's ``--config.init_from``) each process
reads only its devices' blocks, one at a time, straight onto the devices: host memory holds one
device's block of one parameter, never the model.
"""

from __future__ import annotations

import contextlib
import functools
import json
import pathlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from train.io import hf_bitnet
from train.io.hf_config import (
    INDEX_FILE,
    QUANT_SCALE_SUFFIX,
    SINGLE_FILE,
    UnsupportedCheckpointError,
    _Piece,
    _sources,
    model_config_from_hf,
    read_config,
)
from train.model import ModelConfig, Transformer

_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # old Llama checkpoints store RoPE's buffer


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
# safetensors dtypes a weight may be stored in (an integer or bool tensor would be cast to float and trained).
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


@contextlib.contextmanager
def _opened(files: list[pathlib.Path]) -> Iterator[dict[str, _Tensor]]:
  """Every tensor of ``files`` by name, the files held open; only their headers are read."""
  from safetensors import safe_open  # noqa: PLC0415  (optional dependency: the hf / train extras)

  with contextlib.ExitStack() as stack:
    tensors = {}
    for file in files:
      try:
        f = stack.enter_context(safe_open(str(file), framework="numpy"))
      except Exception as e:  # noqa: BLE001  (safetensors raises its own SafetensorError for a cut or garbled file)
        raise UnsupportedCheckpointError(f"{file}: not a readable safetensors file ({str(e).strip()[:200]}); "
                                         "download or export it again") from None
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
  ``save_pretrained``) comes out float32 ``codes * scale[rows, None]``."""
  file, _, dtype = tensors[name]
  value = _read_slice(file, name, index)
  if dtype == "I8":
    scale = _read_slice(tensors[_scale_name(name)][0], _scale_name(name), index[:1])
    value = value.astype(np.float32) * scale.astype(np.float32)[:, None]
  if not np.isfinite(value).all():  # a NaN weight would surface only as a NaN loss after training starts
    raise UnsupportedCheckpointError(f"tensor {name!r} holds NaN or inf values; this checkpoint cannot be trained from")
  return value


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
  for name, (_, _, dtype) in tensors.items():
    if dtype not in FLOAT_DTYPES + ("I8",):
      raise UnsupportedCheckpointError(f"{path}: tensor {name!r} is stored as {dtype}; weights must be one of "
                                       f"{', '.join(FLOAT_DTYPES)} (or I8 with a {QUANT_SCALE_SUFFIX} tensor)")
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
    merge with :func:`merge_into`). A quantized export's int8 weights come back dequantized. A
    ``BitNetForCausalLM`` folder is read by :func:`train.io.hf_bitnet.load_pretrained`.

  Raises:
    UnsupportedCheckpointError: an unsupported architecture or option, a missing file or tensor,
      a shape config.json does not imply (checked before any weight is read).
    ValueError: ``shardings`` lacks a parameter's path.
  """
  hf_json = read_config(path)
  if hf_bitnet.is_bitnet(hf_json):
    return hf_bitnet.load_pretrained(path, param_dtype, shardings, **overrides)
  config = model_config_from_hf(hf_json, param_dtype=param_dtype, **overrides)
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


__all__ = ["abstract_params", "load_pretrained", "merge_into", "weight_files"]
