"""The training config: every field with its default, the recipe names, and model presets.

Config files in ``configs/`` start from :func:`base_config` (or a preset built on it) and
change what differs, so no field is copied between files. Every field can be overridden on
the command line: ``--config.recipe=int8 --config.model.n_layers=8 --config.steps=500``.

Recipe names (``config.recipe``) map to jaxlowbit recipes in :data:`RECIPES`.
Devices: ``config.mesh`` lays the run over a ``(data, fsdp, tensor)`` mesh (:func:`mesh_shape`)
and ``config.fsdp`` holds the options of ``jaxlowbit.fsdp`` (:func:`fsdp_config`).
``train.spec.resolve`` checks a config once and turns it into the frozen ``RunSpec`` the rest of
the trainer reads; this module is the only one that reads the ConfigDict's fields.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
from ml_collections import config_dict

from jaxlowbit import BitNet, fsdp
from jaxlowbit.recipes import named_recipes
from jaxlowbit.optim import OPTIMIZERS
from jaxlowbit.parallel.fsdp.config import GRAD_REDUCE_DTYPES
from jaxlowbit.parallel.tensor import TRANSPOSED_MODES
from jaxlowbit.scaling import INT8_WEIGHT_SCALINGS
from train.io.hf_config import model_config_from_hf, read_config
from train.model import ModelConfig

# config.recipe names: "bf16" (high precision: every matmul in config.model.dtype) and every
# preset a jaxlowbit recipe declares (jaxlowbit/recipes/: int8, fp8_tensorwise, bitnet, ...).
RECIPES = {"bf16": None, **named_recipes()}


class ConfigError(ValueError):
  """A config field holds a value the trainer cannot run with (the message names it and says what to do)."""
DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
MESH_AUTO = 0  # config.mesh.fsdp: every visible device not used by mesh.data


def recipe_from_name(name: str):
  """The jaxlowbit recipe called ``name`` (None for ``"bf16"``); ConfigError naming the choices."""
  if name not in RECIPES:
    raise ConfigError(f"config.recipe={name!r} is not a known recipe; choose one of {', '.join(RECIPES)}")
  return RECIPES[name]


def _dtype(name: str, field: str):
  if name not in DTYPES:
    raise ConfigError(f"config.model.{field}={name!r}; choose one of {', '.join(DTYPES)}")
  return DTYPES[name]


def base_config() -> ml_collections.ConfigDict:
  """All fields with defaults (a small model on the standard-library corpus)."""
  config = ml_collections.ConfigDict()
  config.seed = 0  # parameter init, data order and the dropout key all derive from it
  config.recipe = "bf16"  # a key of train.config.RECIPES
  config.optimizer = "adamw"  # a key of train.optimizer.OPTIMIZERS (= jaxlowbit.optim.OPTIMIZERS)
  # A Hugging Face Llama / Qwen2 / Mistral folder (train.hf): the model's shape comes from its
  # config.json and its weights replace the fresh init; its tokenizer.json becomes data.tokenizer.
  config.init_from = ""

  # Steps and batch: one step is one optimizer update on batch_size sequences of seq_len tokens.
  config.steps = 1000
  config.batch_size = 32  # sequences per optimizer step (global)
  config.grad_accum_steps = 1  # the batch is split into this many microbatches
  config.seq_len = 256

  # AdamW with linear warmup and cosine decay to min_lr_ratio * lr; global-norm clipping.
  config.lr = 3e-4
  config.warmup_steps = 100
  config.min_lr_ratio = 0.1
  config.weight_decay = 0.1  # on matmul weights and embeddings only, not on norm scales
  config.b1 = 0.9
  config.b2 = 0.95
  config.eps = 1e-8
  config.grad_clip = 1.0  # max global gradient norm; 0 turns clipping off

  # Every field of train.model.ModelConfig with its default (that docstring says what each means),
  # in config form: dtypes by name, filter_fqns comma-separated; the recipe is config.recipe.
  config.model = ml_collections.ConfigDict(model_fields())

  config.data = ml_collections.ConfigDict()
  data = config.data
  data.source = "text"  # text | tokens | synthetic | hf (train/data.py)
  data.tokenizer = "byte"  # byte | the path of a Hugging Face tokenizer.json (or a folder holding one)
  data.path = ""  # text: comma-separated files/folders ("" = Python stdlib sources); tokens: the .bin file
  data.suffixes = ".py"  # text: comma-separated file endings searched in folders
  data.val_path = ""  # tokens: a separate validation token file ("" = the tail of data.path)
  data.val_fraction = 0.05
  data.hf_name = ""
  data.hf_config = ""
  data.hf_split = "train"
  data.hf_text_field = "text"
  data.hf_max_docs = 100_000

  # Devices (jaxlowbit.fsdp): a (data, fsdp, tensor) mesh. Parameters and optimizer state are sharded
  # over `fsdp` and replicated over `data`; every (micro)batch is split over data x fsdp. Tensor
  # parallelism splits attention heads and MLP hidden units over `tensor` (each of its devices
  # holds the same sequences and computes its share; docs/training.md says when it pays).
  # data x fsdp x tensor = 1 is the unsharded run (one device, the plain jitted step).
  config.mesh = ml_collections.ConfigDict()
  config.mesh.fsdp = MESH_AUTO  # devices per FSDP group: 0 = all visible devices / (mesh.data x mesh.tensor); 1 = off
  config.mesh.data = 1  # FSDP groups (data-parallel replicas)
  config.mesh.tensor = 1  # devices per tensor-parallel group (fused_projections=False moves no weights over it)
  # True: a step over several GPUs compiles with XLA's latency-hiding scheduler and pipelined collectives, so
  # weight gathers and gradient reduce-scatters overlap the GEMMs (jaxlowbit.parallel.overlap lists the options);
  # no effect on one device or on CPUs. False: XLA's defaults.
  config.mesh.xla_overlap = True
  config.fsdp = ml_collections.ConfigDict()
  config.fsdp.int8_weight_scaling = "row"  # row | tensor: INT8 weight gathers (jaxlowbit.fsdp.FsdpConfig)
  config.fsdp.remat = "save_gathered"  # save_gathered | regather: gathered weight kept for the backward or not
  # float32 | bfloat16: what FSDP's gradient reduce-scatters sum in (bfloat16: half the bytes; FsdpConfig says more)
  config.fsdp.grad_reduce_dtype = "float32"
  # requantize | send: a tensor-parallel gather's x^T for INT8 / FP8 rowwise / BitNet grad_weight made from the
  # gathered codes (1 byte per element on the tensor axis) or sent beside them (2; the unsplit numbers exactly)
  config.fsdp.tensor_transposed = "requantize"

  # Logging, evaluation, checkpoints.
  config.log_every = 10
  config.eval_every = 200
  config.eval_batches = 8  # fixed validation batches of batch_size sequences
  config.checkpoint_every = 500
  config.keep_checkpoints = 3
  config.async_checkpointing = True
  config.resume = False  # also --resume on the command line
  config.peak_tflops = config_dict.placeholder(float)  # bf16 dense peak for MFU; None: look up the device
  config.tensorboard = True  # write TensorBoard events when tensorboardX or torch's writer is importable

  # Fault injection (tests, drills): the parameters turn NaN right before this step; -1 never.
  config.inject_nan_at_step = -1
  return config


def llama_125m() -> ml_collections.ConfigDict:
  """~122M parameters (d 768, 14 layers, GQA 12/4 heads, SwiGLU 3072), for convergence runs."""
  config = base_config()
  config.model.update(d_model=768, n_layers=14, n_heads=12, n_kv_heads=4, d_ff=3072)
  config.update(steps=2000, batch_size=32, seq_len=1024, lr=1e-3, warmup_steps=200)
  config.update(log_every=20, eval_every=250, eval_batches=16, checkpoint_every=500)
  return config


def llama_1b() -> ml_collections.ConfigDict:
  """~0.97B parameters: Llama 3.2 1B's trunk (d 2048, 16 layers, 32/8 heads, SwiGLU 8192), for one H200.

  The vocabulary is the byte tokenizer's (384 rows instead of Llama's 128k), so the
  parameters sit in the matmuls that the recipes quantize, which is what speed runs measure.
  Fast defaults, measured on one H200 (docs/benchmarks.md, "Training step"): a step is 8 x 2048
  tokens in ONE microbatch, the 16 layers unrolled (a scan copies every layer's activations and
  gradients in and out of its stacked buffers) and no rematerialization; compiling takes
  10-30 s. On an 80 GB H100 add ``--config.grad_accum_steps=2`` (half the activation memory).
  """
  config = base_config()
  config.model.update(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192, rope_theta=500_000.0)
  config.model.scan_layers = False
  config.update(steps=10_000, batch_size=8, grad_accum_steps=1, seq_len=2048, lr=3e-4, warmup_steps=500)
  config.update(log_every=10, eval_every=500, eval_batches=8, checkpoint_every=1000)
  return config


def llama_8b() -> ml_collections.ConfigDict:
  """~7.0B-parameter trunk of Llama 3 8B (d 4096, 32 layers, 32/8 heads, SwiGLU 14336) for 8 GPUs.

  FSDP over every visible device (``mesh.fsdp=0``): parameters and optimizer state (96 GB in
  float32 with AdamW) are split eight ways; quantized recipes gather their weights in 8 bits
  (ternary: 2). Byte vocabulary as in :func:`llama_1b`. A step is 32 x 2048 tokens (four
  sequences per GPU) in one microbatch, layers unrolled, no rematerialization: the same
  settings as the 1B config, chosen by the 1B measurements (no 8-GPU machine was lent to
  measure these; on GPUs with less memory than an H200 raise ``grad_accum_steps``).
  """
  config = base_config()
  config.model.update(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336, rope_theta=500_000.0)
  config.model.scan_layers = False
  config.update(steps=10_000, batch_size=32, grad_accum_steps=1, seq_len=2048, lr=3e-4, warmup_steps=500)
  config.update(log_every=10, eval_every=500, eval_batches=4, checkpoint_every=1000, keep_checkpoints=2)
  return config


def llama_8b_layers(n_layers: int = 4) -> ml_collections.ConfigDict:
  """Llama 3 8B's layers (:func:`llama_8b`'s shape) ``n_layers`` deep, for 2 x 80 GB: configs/layers_8b.py.

  FSDP over every visible device, 16 sequences of 2048 per step (8 per GPU on two) in one microbatch;
  the memory budget is in that file's docstring.
  """
  config = llama_8b()
  config.model.n_layers = n_layers
  config.update(batch_size=16, eval_batches=4)
  return config


# Model fields that go with a recipe (besides config.recipe): BitNet trains the published b1.58 2B4T form, as
# configs/bitnet_*.py do.
BITNET_MODEL_FIELDS = {"bitnet_norm_placement": "sub", "tie_embeddings": True}


def with_recipe(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
  """``config`` with ``config.recipe = name`` and the model fields that go with it (:data:`BITNET_MODEL_FIELDS`
  for a BitNet recipe); ConfigError for an unknown name. For one config file serving every recipe
  (``--config=configs/layers_8b.py:int8``)."""
  recipe = recipe_from_name(name)
  config.recipe = name
  if isinstance(recipe, BitNet):
    config.model.update(BITNET_MODEL_FIELDS)
  return config


# ModelConfig fields whose config form differs: (to config, from config). The recipe is config.recipe.
_MODEL_FIELD_FORMS = {
    "dtype": (lambda dtype: jnp.dtype(dtype).name, lambda name: _dtype(name, "dtype")),
    "param_dtype": (lambda dtype: jnp.dtype(dtype).name, lambda name: _dtype(name, "param_dtype")),
    "filter_fqns": (",".join, lambda text: tuple(f.strip() for f in text.split(",") if f.strip())),
    "rope_scaling": (lambda values: ",".join(repr(float(v)) for v in values),
                     lambda text: tuple(float(f) for f in text.split(",") if f.strip())),
}
_MODEL_FIELDS_ELSEWHERE = frozenset({"recipe"})


def model_fields() -> dict:
  """``config.model``'s defaults: every :class:`ModelConfig` field in its config form."""
  fields = {}
  for field in dataclasses.fields(ModelConfig):
    if field.name not in _MODEL_FIELDS_ELSEWHERE:
      to_config = _MODEL_FIELD_FORMS.get(field.name, (lambda v: v, None))[0]
      fields[field.name] = to_config(field.default)
  return fields


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  """The model's frozen :class:`ModelConfig` from ``config.model`` and ``config.recipe``."""
  values = {}
  for name, value in config.model.items():
    from_config = _MODEL_FIELD_FORMS.get(name, (None, lambda v: v))[1]
    values[name] = from_config(value)
  return ModelConfig(**values, recipe=recipe_from_name(config.recipe))


# Fields that must be integers >= 1, and the ranges of the numeric ones (the rest of check()).
POSITIVE_INTS = ("steps", "batch_size", "grad_accum_steps", "seq_len", "log_every", "eval_every", "eval_batches",
                 "checkpoint_every", "keep_checkpoints", "data.hf_max_docs")
POSITIVE_MODEL_INTS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")
# Upper bounds where a larger value runs but cannot train (issue 31: eps=1e30 and norm_eps=1e30 trained models that
# did not learn, exit 0). AdamW's eps is added to sqrt(v), the RMS of a gradient element: the usual 1e-8..1e-6 sit far
# below it; at 1e-2 an element with gradients below 1e-2 (most of them, after clipping to norm 1) already moves at
# lr * g / 1e-2 instead of lr * sign(g), so beyond it eps, not lr, sets the step. RMSNorm's eps is added to the mean
# square of the activations, about 1 at init: 1e-2 still changes the normalised output by 0.5%, 1 halves it.
EPS_MAX = 1e-2
NORM_EPS_MAX = 1e-2
# Normal init std: GPT-2/Llama use 0.02; at 1 the logits of a wide model start at tens and the first steps diverge.
INIT_STD_MAX = 1.0
# Seeds go to jax.random.key and numpy's default_rng: both take 32-bit seeds without truncating.
SEED_MAX = 2**32 - 1
# (field, low, high, low included, high included); None: unbounded. Every numeric value must also be finite.
RANGES = (
    ("lr", 0.0, None, False, True),
    ("min_lr_ratio", 0.0, 1.0, True, True),
    ("weight_decay", 0.0, None, True, True),
    ("b1", 0.0, 1.0, True, False),
    ("b2", 0.0, 1.0, True, False),  # b2 = 1: v never forgets (and the bias correction divides by 0)
    ("eps", 0.0, EPS_MAX, False, True),
    ("grad_clip", 0.0, None, True, True),  # 0 turns clipping off
    ("model.dropout_rate", 0.0, 1.0, True, False),
    ("model.rope_theta", 0.0, None, False, True),
    ("model.norm_eps", 0.0, NORM_EPS_MAX, False, True),
    ("model.init_std", 0.0, INIT_STD_MAX, False, True),
    ("data.val_fraction", 0.0, 1.0, False, False),
)
OPTIONAL_RANGES = (("peak_tflops", 0.0, None, False, True),)  # None: look the device up
# Integer fields with other bounds than >= 1: (field, low, high), both included; None: unbounded.
INT_RANGES = (
    ("seed", 0, SEED_MAX),
    ("mesh.data", 1, None),
    ("mesh.fsdp", MESH_AUTO, None),
    ("mesh.tensor", 1, None),
    ("inject_nan_at_step", -1, None),
)
DATA_SOURCES = ("text", "tokens", "synthetic", "hf")
ROPE_SCALING_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _get(config, field: str):
  for key in field.split("."):
    config = config[key]
  return config


def _in_range(value, low, high, low_in, high_in) -> bool:
  if not math.isfinite(value):
    return False
  if low is not None and (value < low or (value == low and not low_in)):
    return False
  return high is None or value < high or (value == high and high_in)


def _bounds(low, high, low_in, high_in) -> str:
  upper = "inf)" if high is None else f"{high}{']' if high_in else ')'}"
  return f"{'[' if low_in else '('}{low}, {upper}"


def _unknown_fields(config, reference, prefix="") -> list[str]:
  unknown = []
  for key in config.keys():
    if key not in reference:
      unknown.append(prefix + key)
    elif isinstance(config[key], ml_collections.ConfigDict) and isinstance(reference[key], ml_collections.ConfigDict):
      unknown += _unknown_fields(config[key], reference[key], f"{prefix}{key}.")
  return unknown


def _is_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_types(config, reference, prefix="") -> None:
  """ConfigError for a field whose value has another type than its default's (bool, int, float, str)."""
  for key in reference.keys():
    default, value, field = reference[key], config[key], prefix + key
    if isinstance(default, ml_collections.ConfigDict):
      _check_types(value, default, field + ".")
      continue
    if isinstance(default, bool):
      ok, kind = isinstance(value, bool), "True or False"
    elif isinstance(default, int):
      ok, kind = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif isinstance(default, float) or default is None:  # None: a float placeholder (peak_tflops)
      ok, kind = _is_number(value) or (default is None and value is None), "a number"
    elif isinstance(default, str):
      ok, kind = isinstance(value, str), "a string"
    else:
      continue
    if not ok:
      raise ConfigError(f"config.{field} must be {kind}, got {value!r}")


def _rope_scaling(text: str) -> None:
  if not text.strip():
    return
  parts = [part.strip() for part in text.split(",")]
  try:
    values = [float(part) for part in parts]
  except ValueError:
    values = []
  if len(values) != len(ROPE_SCALING_FIELDS) or not all(math.isfinite(v) and v > 0 for v in values):
    raise ConfigError(f"config.model.rope_scaling={text!r}: '' (none) or four positive numbers "
                      f"'{','.join(ROPE_SCALING_FIELDS)}', e.g. '32.0,1.0,4.0,8192.0' (Llama 3.1)")


def check(config: ml_collections.ConfigDict) -> None:
  """ConfigError for any field the trainer cannot run with, naming it (the devices: :func:`mesh_shape`).

  Every field is checked here, before anything is built or printed: fields this trainer does not
  know, every value's type (that of its default), names against closed lists (recipe, optimizer,
  dtypes, data source, FSDP options, remat policy, attention), integer sizes >= 1, finite numbers
  in their ranges (:data:`RANGES`, :data:`INT_RANGES`), ``model.rope_scaling``'s four numbers and
  the model's shape rules (``ModelConfig``).
  """
  unknown = _unknown_fields(config, base_config())
  if unknown:
    raise ConfigError(f"config has unknown field(s) {unknown}; see train/config.py base_config() for every field")
  _check_types(config, base_config())
  for field in POSITIVE_INTS + tuple(f"model.{f}" for f in POSITIVE_MODEL_INTS):
    value = _get(config, field)
    if value < 1:
      raise ConfigError(f"config.{field} must be an integer >= 1, got {value!r}")
  for field, low, high in INT_RANGES:
    value = _get(config, field)
    if value < low or (high is not None and value > high):
      raise ConfigError(f"config.{field} must be an integer in [{low}, {'inf)' if high is None else f'{high}]'}, "
                        f"got {value!r}")
  for field, low, high, low_in, high_in in RANGES + OPTIONAL_RANGES:
    value = _get(config, field)
    if value is None and field in dict((f[0], f) for f in OPTIONAL_RANGES):
      continue
    if not _in_range(value, low, high, low_in, high_in):
      optional = " (or None: look up the device)" if field in dict((f[0], f) for f in OPTIONAL_RANGES) else ""
      raise ConfigError(f"config.{field} must be a finite number in {_bounds(low, high, low_in, high_in)}{optional}, "
                        f"got {value!r}")
  if config.batch_size % config.grad_accum_steps:
    raise ConfigError(
        f"config.batch_size={config.batch_size} is not a multiple of grad_accum_steps={config.grad_accum_steps}"
    )
  if config.warmup_steps < 0 or config.warmup_steps > config.steps:
    raise ConfigError(f"config.warmup_steps={config.warmup_steps} must lie in [0, steps={config.steps}]")
  if config.data.source not in DATA_SOURCES:
    raise ConfigError(f"config.data.source={config.data.source!r}; choose one of {DATA_SOURCES}")
  tokenizer = pathlib.Path(config.data.tokenizer)
  if config.data.tokenizer != "byte" and not (tokenizer.is_file() or (tokenizer / "tokenizer.json").is_file()):
    raise ConfigError(f"config.data.tokenizer={config.data.tokenizer!r}: 'byte' or a tokenizer.json (or its folder)")
  if config.init_from and not (pathlib.Path(config.init_from) / "config.json").is_file():
    raise ConfigError(f"config.init_from={config.init_from!r}: not a Hugging Face model folder (no config.json)")
  if config.mesh.tensor > 1:
    _check_tensor_parallel(config)
  _rope_scaling(config.model.rope_scaling)
  try:
    if config.optimizer not in OPTIMIZERS:
      raise ConfigError(f"config.optimizer={config.optimizer!r} is not an optimizer; choose one of "
                        f"{', '.join(OPTIMIZERS)}")
    fsdp_config(config)
    model_config(config)  # the model's own rules: heads divide d_model, known remat policy, ...
  except ConfigError:
    raise
  except (ValueError, TypeError) as e:
    raise ConfigError(str(e)) from e


def _check_tensor_parallel(config: ml_collections.ConfigDict) -> None:
  """ConfigError for a model that ``config.mesh.tensor`` cannot split (heads, hidden units)."""
  tensor, model = config.mesh.tensor, config.model
  for field in ("n_heads", "n_kv_heads", "d_ff"):
    if model[field] % tensor:
      raise ConfigError(f"config.mesh.tensor={tensor} does not divide config.model.{field}={model[field]}: each "
                        f"tensor-parallel device computes {field} / tensor of them; choose a tensor size that divides "
                        "n_heads, n_kv_heads and d_ff")


def adjust(config: ml_collections.ConfigDict) -> list[str]:
  """Make a config that only asks for something too long runnable; the notices say what changed.

  A warmup longer than the run (``--config.steps=50`` on a config warming up over 500 steps:
  what people try first) is shortened to the whole run. With ``init_from``, the model's shape
  fields come from the checkpoint's config.json and its tokenizer.json replaces the byte tokenizer.
  """
  notes = []
  if config.get("init_from") and (pathlib.Path(config.init_from) / "config.json").is_file():
    notes += _adopt_pretrained(config)
  if isinstance(config.warmup_steps, int) and isinstance(config.steps, int) and config.warmup_steps > config.steps > 0:
    notes.append(f"note: config.warmup_steps={config.warmup_steps} is longer than the run; warming up over all "
                 f"{config.steps} steps instead")
    config.warmup_steps = config.steps
  return notes


# ModelConfig fields that a Hugging Face config.json decides (train.io.hf_config.model_config_from_hf).
PRETRAINED_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "rope_theta",
                     "rope_scaling", "attention_bias", "norm_eps", "tie_embeddings", "mlp_activation")
# A BitNetForCausalLM folder also decides these (its BitNet b1.58 graph: the sub-norms).
PRETRAINED_BITNET_FIELDS = ("bitnet_norms", "bitnet_norm_placement")


def _adopt_pretrained(config: ml_collections.ConfigDict) -> list[str]:
  pretrained = model_config_from_hf(read_config(config.init_from))
  notes = []
  bitnet = isinstance(pretrained.recipe, BitNet)
  if bitnet and not isinstance(recipe_from_name(config.recipe), BitNet):
    notes.append(f"config.recipe: {config.recipe} -> bitnet (a BitNetForCausalLM checkpoint)")
    config.recipe = "bitnet"
  for field in PRETRAINED_FIELDS + (PRETRAINED_BITNET_FIELDS if bitnet else ()):
    value, old = getattr(pretrained, field), config.model[field]
    to_config = _MODEL_FIELD_FORMS.get(field, (lambda v: v, None))[0]
    value = to_config(value)
    if old != value:
      notes.append(f"config.model.{field}: {old!r} -> {value!r}")
      config.model[field] = value
  tokenizer = pathlib.Path(config.init_from) / "tokenizer.json"
  if config.data.tokenizer == "byte" and tokenizer.is_file():
    config.data.tokenizer = str(tokenizer)
    notes.append(f"config.data.tokenizer: byte -> {tokenizer}")
  return [f"note: init_from {config.init_from}: " + "; ".join(notes)] if notes else []


def mesh_shape(
    config: ml_collections.ConfigDict, device_count: int | None = None, process_count: int | None = None
) -> tuple[int, int, int]:
  """``(data, fsdp, tensor)``: the run's mesh, ``config.mesh`` resolved against the visible devices.

  ``mesh.fsdp=0`` (auto) takes every device not used by ``mesh.data`` and ``mesh.tensor``: FSDP
  over all devices as soon as more than one is visible, and ``(1, 1, 1)``, the unsharded run, on
  one device. A single process may use the first ``data x fsdp x tensor`` of its devices; a
  multi-process run uses all of them.

  Args:
    config: a training config that passed :func:`check` (``train.spec.resolve`` runs both, once).
    device_count, process_count: default ``jax.device_count()``, ``jax.process_count()``.

  Raises:
    ConfigError: sizes that do not fit the devices, a microbatch (``batch_size /
      grad_accum_steps`` sequences) that does not split evenly over the ``data x fsdp`` groups,
      or a group's tokens that do not split over its ``tensor`` devices.
  """
  devices = jax.device_count() if device_count is None else device_count
  processes = jax.process_count() if process_count is None else process_count
  data, size, tensor = config.mesh.data, config.mesh.fsdp, config.mesh.tensor
  names = f"data={data} x fsdp={{}}" + (f" x tensor={tensor}" if tensor > 1 else "")
  if size == MESH_AUTO:
    if devices % (data * tensor):
      groups = f"config.mesh.data={data}" + (f" x tensor={tensor}" if tensor > 1 else "")
      raise ConfigError(f"{groups} does not divide the {devices} visible devices")
    size = devices // (data * tensor)
  used = data * size * tensor
  if used > devices:
    raise ConfigError(
        f"config.mesh: {names.format(size)} needs {used} devices but {devices} are visible; "
        "lower them, or set --config.mesh.fsdp=0 to use every device"
    )
  if processes > 1 and used != devices:
    raise ConfigError(
        f"config.mesh: {names.format(size)} uses {used} of the {devices} devices of this "
        f"{processes}-process run; a multi-process run must use all of them (--config.mesh.fsdp=0)"
    )
  micro = config.batch_size // config.grad_accum_steps
  if micro % (data * size):
    raise ConfigError(
        f"config.batch_size={config.batch_size} makes microbatches of {micro} sequences "
        f"(grad_accum_steps={config.grad_accum_steps}), which do not split over the {data * size} data x fsdp "
        f"groups of the mesh ({names.format(size)}); make batch_size a multiple of "
        f"{config.grad_accum_steps * data * size} or change config.mesh"
    )
  tokens = micro // (data * size) * config.seq_len
  if tokens % tensor:
    raise ConfigError(
        f"config.mesh.tensor={tensor}: each data x fsdp group computes {micro // (data * size)} sequences of "
        f"seq_len={config.seq_len} tokens per microbatch ({tokens} tokens), which do not split over its {tensor} "
        "tensor-parallel devices; make seq_len (or the sequences per group) a multiple of the tensor size"
    )
  return data, size, tensor


def fsdp_config(config: ml_collections.ConfigDict) -> fsdp.FsdpConfig:
  """``jaxlowbit.fsdp.FsdpConfig`` from ``config.fsdp`` (ValueError naming the field and its choices)."""
  options = config.fsdp
  if options.int8_weight_scaling not in INT8_WEIGHT_SCALINGS:
    raise ConfigError(
        f"config.fsdp.int8_weight_scaling={options.int8_weight_scaling!r}; choose one of {INT8_WEIGHT_SCALINGS}"
    )
  if options.remat not in fsdp.REMAT_MODES:
    raise ConfigError(f"config.fsdp.remat={options.remat!r}; choose one of {fsdp.REMAT_MODES}")
  if options.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
    raise ConfigError(f"config.fsdp.grad_reduce_dtype={options.grad_reduce_dtype!r}; choose one of "
                      f"{GRAD_REDUCE_DTYPES}")
  transposed = options.get("tensor_transposed", TRANSPOSED_MODES[0])  # configs saved before the field
  if transposed not in TRANSPOSED_MODES:
    raise ConfigError(f"config.fsdp.tensor_transposed={transposed!r}; choose one of {TRANSPOSED_MODES}")
  return fsdp.FsdpConfig(int8_weight_scaling=options.int8_weight_scaling, remat=options.remat,
                         grad_reduce_dtype=options.grad_reduce_dtype, tensor_transposed=transposed)


def to_json(config: ml_collections.ConfigDict) -> str:
  """The config as indented JSON (what ``RUN_DIR/config.json`` holds)."""
  return json.dumps(json.loads(config.to_json_best_effort()), indent=2, sort_keys=True) + "\n"


def load_file(path: str | pathlib.Path, overrides: dict | None = None) -> ml_collections.ConfigDict:
  """``get_config()`` of a config file, with ``overrides`` (dotted keys) applied.

  ``"configs/x.py:arg"`` calls ``get_config("arg")``, as ``--config=configs/x.py:arg`` does on the
  command line. For scripts that build several configs in one process (benchmarks); the command
  line uses ``ml_collections.config_flags`` instead.
  """
  text, arg = str(path), None
  if ":" in text and not pathlib.Path(text).is_file():
    text, _, arg = text.rpartition(":")
  path = pathlib.Path(text)
  spec = importlib.util.spec_from_file_location(f"_config_{path.stem}", path)
  if spec is None or spec.loader is None:
    raise FileNotFoundError(f"no config file at {path}")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config() if arg is None else module.get_config(arg)
  for key, value in (overrides or {}).items():
    parent = config
    *parents, leaf = key.split(".")
    for name in parents:
      parent = parent[name]
    if leaf not in parent:
      raise KeyError(f"{path}: config has no field {key!r}")
    parent[leaf] = value
  return config
