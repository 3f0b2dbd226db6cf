"""The run, resolved once: a frozen description every part of the trainer reads instead of the config.

    config = ...                                  # ml_collections.ConfigDict: configs/*.py + flags
    spec = train.spec.resolve(config)             # checked once, the mesh fitted to the devices
    functions = train.steps.step_functions(spec)  # cached on spec.compiled

:func:`resolve` runs ``train.config.check`` once, resolves ``config.mesh`` against the visible
devices and turns every field into typed values: the model's :class:`~train.model.ModelConfig`,
the mesh shape, ``jaxlowbit.fsdp.FsdpConfig``, the optimizer's and the data's fields. The loop,
runtime, step functions, optimizer and generation take a :class:`RunSpec`; only ``train/config.py``
(check, adjust, the ``config.json`` text) and this module read the ConfigDict; the entry points
(``train.main``, ``loop.train``'s first lines) only hand it here. A spec is frozen and hashable:
:attr:`RunSpec.compiled` (the spec without the fields that change nothing inside the jitted
functions) is the step functions' cache key.

A run's ``config.json`` (the config as the run resolved it, for people and for the diff on
resume) is :attr:`RunSpec.config_json`, written by :func:`build` from the config it built the spec
of; :func:`from_saved` turns a saved one back into a spec (``train.runs.load_run``, the resume check
of ``train.run_control``).

Field names are the config's (``spec.seq_len`` is ``config.seq_len``, ``spec.optimizer.lr`` is
``config.lr``, ``spec.data.source`` is ``config.data.source``), so a config diff names spec fields.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import ml_collections

from jaxlowbit import execution as jaxlowbit_execution
from jaxlowbit import fsdp
from jaxlowbit.execution import ExecutionOptions
from train import config as train_config
from train.model import ModelConfig

# Config fields that change nothing inside the jitted functions. Runs in one process whose
# configs differ only in these reuse the functions compiled for an earlier run (a resume in a
# notebook, tests, benchmarks); any other difference compiles afresh, so the cache is never stale.
RUNTIME_ONLY_FIELDS = frozenset({
    "resume", "log_every", "eval_every", "eval_batches", "checkpoint_every", "keep_checkpoints",
    "async_checkpointing", "tensorboard", "peak_tflops", "data", "inject_nan_at_step",
})


class MeshShape(NamedTuple):
  """``(data, fsdp, tensor)``: ``config.mesh`` resolved against the devices (``train.config.mesh_shape``)."""

  data: int
  fsdp: int
  tensor: int

  @property
  def devices(self) -> int:
    return self.data * self.fsdp * self.tensor


UNSHARDED = MeshShape(1, 1, 1)  # one device: the plain jitted step


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  """AdamW named ``name`` (a key of ``train.optimizer.OPTIMIZERS``), its schedule and clipping (``train/config.py``)."""

  name: str
  lr: float
  warmup_steps: int
  min_lr_ratio: float
  weight_decay: float
  b1: float
  b2: float
  eps: float
  grad_clip: float


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """``config.data``: where the tokens come from (``train/data.py``)."""

  source: str
  tokenizer: str
  path: str
  suffixes: str
  val_path: str
  val_fraction: float
  hf_name: str
  hf_config: str
  hf_split: str
  hf_text_field: str
  hf_max_docs: int


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One run, resolved: what the trainer reads (every field has the meaning of ``train/config.py``'s).

  Attributes:
    model: the model (``config.model`` with ``config.recipe``'s jaxlowbit recipe).
    mesh: ``(data, fsdp, tensor)``; :data:`UNSHARDED` is the one-device run.
    fsdp: ``jaxlowbit.fsdp`` options (``config.fsdp``).
    xla_overlap: ``config.mesh.xla_overlap``: compile a multi-GPU step with XLA's collective overlap
      options (``jaxlowbit.parallel.overlap``).
    optimizer: ``config.optimizer`` and its hyperparameters.
    recipe: ``config.recipe``, the name (for logs and generation notes).
    execution: how jaxlowbit runs the run's kernels (``jaxlowbit.ExecutionOptions``, its backend
      resolved: given to :func:`resolve`, else ``$JAXLOWBIT_BACKEND`` read once there). The model,
      the optimizer's update and the step's BitNet weights take it explicitly; part of the cache key.
    data: ``config.data``; None in :attr:`compiled`.
    seed, steps, batch_size, grad_accum_steps, seq_len, init_from: as in the config.
    log_every ... inject_nan_at_step: the loop's cadence and switches (:data:`RUNTIME_ONLY_FIELDS`);
      None in :attr:`compiled`.
    config_json: the config it was built from as ``config.json`` text (:func:`build`); compared by
      nobody (``compare=False``).
  """

  model: ModelConfig
  mesh: MeshShape
  fsdp: fsdp.FsdpConfig
  xla_overlap: bool
  optimizer: OptimizerSpec
  recipe: str
  execution: ExecutionOptions
  data: DataSpec | None
  seed: int
  steps: int
  batch_size: int
  grad_accum_steps: int
  seq_len: int
  init_from: str
  log_every: int | None
  eval_every: int | None
  eval_batches: int | None
  checkpoint_every: int | None
  keep_checkpoints: int | None
  async_checkpointing: bool | None
  resume: bool | None
  peak_tflops: float | None
  tensorboard: bool | None
  inject_nan_at_step: int | None
  # The config the spec was built from, as config.json holds it (``train.config.to_json``): written into
  # the run directory and diffed on resume. Not part of the spec's identity (equality, hash, cache key).
  config_json: str = dataclasses.field(default="{}", compare=False, repr=False)

  @property
  def compiled(self) -> RunSpec:
    """This spec with every field of :data:`RUNTIME_ONLY_FIELDS` None: what the jitted functions depend on."""
    return dataclasses.replace(self, **dict.fromkeys(RUNTIME_ONLY_FIELDS))

  @property
  def tokens_per_step(self) -> int:
    return self.batch_size * self.seq_len


def resolve(config: ml_collections.ConfigDict, device_count: int | None = None,
            process_count: int | None = None, *, execution: ExecutionOptions | None = None) -> RunSpec:
  """The :class:`RunSpec` of ``config`` on the visible devices, built once at the start of a run.

  Args:
    config: a training config (after ``train.config.adjust``, which may rewrite fields).
    device_count, process_count: default ``jax.device_count()``, ``jax.process_count()``.
    execution: how the kernels run (``jaxlowbit.ExecutionOptions``); None: the defaults, the backend
      from ``$JAXLOWBIT_BACKEND`` (the trainer's one reading of the environment).

  Raises:
    train.config.ConfigError: any field the trainer cannot run with, or a mesh the devices or the
      batch cannot hold (``train.config.check``, ``train.config.mesh_shape``).
  """
  train_config.check(config)
  return build(config, MeshShape(*train_config.mesh_shape(config, device_count, process_count)), execution)


def build(config: ml_collections.ConfigDict, mesh: MeshShape, execution: ExecutionOptions | None = None) -> RunSpec:
  """The :class:`RunSpec` of a config already checked, on ``mesh`` (no device lookup).

  For a run's saved ``config.json`` (``train.runs.load_run``: the run was checked when it
  started; its tokenizer or ``init_from`` folder need not exist here) and for :func:`resolve`.
  ``execution`` as in :func:`resolve` (None: the defaults, the backend from the environment).
  """
  return RunSpec(
      model=train_config.model_config(config),
      mesh=MeshShape(*mesh),
      fsdp=train_config.fsdp_config(config),
      xla_overlap=config.mesh.xla_overlap,
      optimizer=OptimizerSpec(
          name=config.optimizer, lr=config.lr, warmup_steps=config.warmup_steps, min_lr_ratio=config.min_lr_ratio,
          weight_decay=config.weight_decay, b1=config.b1, b2=config.b2, eps=config.eps, grad_clip=config.grad_clip),
      recipe=config.recipe,
      execution=jaxlowbit_execution.resolve(execution),
      data=DataSpec(**{field.name: config.data[field.name] for field in dataclasses.fields(DataSpec)}),
      seed=config.seed,
      steps=config.steps,
      batch_size=config.batch_size,
      grad_accum_steps=config.grad_accum_steps,
      seq_len=config.seq_len,
      init_from=config.init_from,
      log_every=config.log_every,
      eval_every=config.eval_every,
      eval_batches=config.eval_batches,
      checkpoint_every=config.checkpoint_every,
      keep_checkpoints=config.keep_checkpoints,
      async_checkpointing=config.async_checkpointing,
      resume=config.resume,
      peak_tflops=config.peak_tflops,
      tensorboard=config.tensorboard,
      inject_nan_at_step=config.inject_nan_at_step,
      config_json=train_config.to_json(config),
  )


def from_saved(saved: dict, mesh: MeshShape = UNSHARDED, execution: ExecutionOptions | None = None) -> RunSpec:
  """The :class:`RunSpec` of a run's saved ``config.json`` (parsed), built unchecked on ``mesh``.

  The saved fields go over :func:`train.config.base_config` (a field added since the run takes its
  default). Unchecked as in :func:`build`: the run was checked when it started. ``execution`` as in
  :func:`resolve` (how the kernels run is this process's choice, not the saved run's).

  Raises:
    TypeError, ValueError, KeyError: a saved value this version cannot hold (ml_collections' type
      checks, the model's own); callers that compare runs treat it as "cannot say".
  """
  config = train_config.base_config()
  config.update(ml_collections.ConfigDict(saved))
  return build(config, mesh, execution)


__all__ = [
    "RUNTIME_ONLY_FIELDS", "UNSHARDED", "DataSpec", "MeshShape", "OptimizerSpec", "RunSpec", "build", "from_saved",
    "resolve",
]
