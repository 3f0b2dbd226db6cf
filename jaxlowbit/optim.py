"""Low-bit AdamW for optax: 8-bit, 4-bit and FP8 optimizer states, and bf16 weights.

Swap one line::

    tx = optax.adamw(3e-4, weight_decay=0.1)               # two float32 copies of the model
    tx = jaxlowbit.optim.adamw_8bit(3e-4, weight_decay=0.1)  # ~0.25x the state bytes

Every optimizer here is ``optax.chain(scale_by_adam_quantized(...), add_decayed_weights,
scale_by_learning_rate)``, exactly like ``optax.adamw``, and composes with ``optax.chain``,
schedules, ``optax.clip_by_global_norm`` and ``optax.MultiSteps``.

=============  ===========================  ===========================  =====  ======================
name           first moment ``m``           second moment ``v``          block  state bytes / param
=============  ===========================  ===========================  =====  ======================
adamw          float32                      float32                      -      8
adamw_8bit     8-bit signed dynamic map     8-bit unsigned dynamic map   256    2.03
adamw_4bit     4-bit signed dynamic map     4-bit linear map (no zero)   128    1.06
adamw_fp8      e4m3, scale amax/448         e4m3, scale amax/448         256    2.03
adamw_fp8_o2   e4m3, scale amax/448         float16, scale amax/65504    256    3.03
=============  ===========================  ===========================  =====  ======================

(bitsandbytes' 8-bit Adam; torchao's 4-bit AdamW after Li et al. 2023; torchao's FP8 AdamW;
MS-AMP's O2 optimizer.) Each step dequantizes ``m`` and ``v`` to float32, runs the Adam update
in float32 and re-quantizes; the update of that step uses the float32 moments. On an NVIDIA GPU
this runs as one fused kernel per tensor (``pallas_kernels.adam``, chosen by
``pallas_kernels.dispatch``; the same codes as XLA's update except on exact ties), elsewhere in
XLA. :func:`apply_step` takes the whole step into the parameters: these optimizers are
:class:`FusedStep` s, whose kernel also reads and writes the parameter (weight decay, learning
rate and, after :func:`stochastic_rounding`, bf16 stochastic rounding inside it); :func:`chain`
keeps that behind ``optax.clip_by_global_norm``. Tensors with
fewer than :data:`MIN_QUANTIZED_SIZE` elements, or that :func:`jaxlowbit.qstate.blockable`
refuses, keep float32 moments and follow ``optax.adamw`` bit for bit. A NaN or inf gradient
element turns its block's moments NaN (never a finite value), as it turns optax's. A finite
gradient whose square overflows float32 (optax's ``v`` then holds inf) keeps the state finite: its
element's ``m`` and ``v`` are scaled down together, keeping Adam's ``m / sqrt(v)``
(:func:`jaxlowbit_numerics.adam.fit_moments`); the rest of its block then takes near-zero steps
until the outlier decays, as after any gradient that dwarfs its block.

Each state is of its formats' class (:func:`state_class`; ``state.format_name`` says
``adamw_8bit`` etc.): ``update`` refuses another optimizer's state, naming both, and a state
restored without a target (orbax's dicts); so does :func:`adamw` (``make("adamw")``: ``optax.adamw``
given a low-bit state). ``optax.adamw``'s own ``update`` cannot tell our state from its own (the
fields are named ``mu`` and ``nu`` in both; renaming them would change every checkpoint's layout).

Sharding: every state leaf is one array with its parameter's rank and leading shape (the
state's ``mu``/``nu`` hold codes ``[*lead, N]``, ``mu_scale``/``nu_scale`` block scales
``[*lead, ceil(N / block)]``; see :mod:`jaxlowbit.qstate`), so the parameter's sharding applies
to its state unchanged: FSDP, a ``PartitionSpec`` per parameter, Flax logical axis names
(``nn.get_partition_spec`` of the state) and ``nnx.Optimizer`` all work as with
``optax.adamw``. :func:`state_shardings` maps parameter shardings to the state's.

Under ``optax.inject_hyperparams`` the learning rate, betas, eps and weight decay become
run-time values; ``block_size`` and ``min_size`` are static (leave them at their defaults, or
list them in ``static_args``).

bf16 weights without a float32 master copy: :func:`apply_updates_stochastic` (or the
:func:`stochastic_rounding` transformation last in the chain) rounds ``p + u`` to bf16
stochastically, so updates far below bf16's resolution still move the weights on average.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxlowbit.execution import ExecutionOptions
from jaxlowbit.qstate import BlockFormat, BlockQuantized, blockable, zeros_blockwise
from jaxlowbit.rounding import stochastic_round
from jaxlowbit_numerics import fp8
from jaxlowbit_numerics.adam import adam_coefficients, adam_moments, apply_update
from jaxlowbit_numerics.random import flat_index_bits
from pallas_kernels import dispatch

# Tensors smaller than this keep float32 moments: their state is negligible and they are
# often sensitive (norm scales, biases). The threshold of torchao's and bitsandbytes' optimizers.
MIN_QUANTIZED_SIZE = 4096
# Block sizes: bitsandbytes' blockwise 8-bit optimizers and torchao's 8-bit/FP8 use 256;
# the 4-bit optimizer (Li et al. 2023; torchao) uses 128.
BLOCK_8BIT = 256
BLOCK_4BIT = 128
BLOCK_FP8 = 256


class ScaleByAdamQuantizedState(NamedTuple):
  """State of :func:`scale_by_adam_quantized`: every leaf an array shaped like its parameter.

  Attributes:
    count: int32 scalar, the number of steps taken.
    mu, nu: trees shaped like the parameters: the codes of a quantized tensor (``[*lead, N]``,
      4-bit ``[*lead, N / 2]``) or the moment itself for a tensor kept in float32.
    mu_scale, nu_scale: trees shaped like the parameters: float32 block scales ``[*lead,
      ceil(N / block)]`` (ones for a tensor kept in float32; a scalar parameter's is a scalar).
  """

  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  mu_scale: optax.Updates
  nu_scale: optax.Updates

  # The formats the state's codes are in, and the optimizer's name: set on the subclass that
  # :func:`state_class` makes per pair of formats (None here), so they ride in the pytree's type
  # (static under jit, kept by ``jax.tree.map``, ``eval_shape`` and a restore with a target).
  m_format = None
  v_format = None
  format_name = None


def _format_name(m_format: BlockFormat, v_format: BlockFormat) -> str:
  """``adamw_8bit`` etc. for the formats of :func:`moment_formats` (at any block size), else a description."""
  for name in ("adamw_8bit", "adamw_4bit", "adamw_fp8", "adamw_fp8_o2"):
    if moment_formats(name, m_format.block) == (m_format, v_format):
      return name if m_format.block == moment_formats(name)[0].block else f"{name}(block_size={m_format.block})"
  return f"adamw_quantized(m_format={m_format}, v_format={v_format})"


def _rebuild_state(m_format: BlockFormat, v_format: BlockFormat, fields: tuple) -> ScaleByAdamQuantizedState:
  return state_class(m_format, v_format)(*fields)


# optax's Adam-family updates (``optax.scale_by_adam`` and its kin) read ``state.mu`` and ``state.nu`` as float
# moments. Ours hold block-quantized codes under the same field names (the names are the checkpoint's layout, so they
# stay), and int8 codes broadcast against the gradients without complaint: ``optax.adamw(...).update`` took an
# ``adamw_8bit`` state and returned garbage (issue 31). So a read of those two fields from optax's own code is
# refused; every other reader (ours, a user's, orbax and jax flatten the tuple without attribute access) gets them.
_OPTAX_MODULE = "optax"


def _codes_field(index: int, name: str) -> property:
  def get(self):
    caller = sys._getframe(1).f_globals.get("__name__", "")  # noqa: SLF001  (who reads the field: optax or not)
    if caller == _OPTAX_MODULE or caller.startswith(_OPTAX_MODULE + "."):
      raise TypeError(
          f"{caller}: got the state of {self.format_name}, whose {name} holds block-quantized codes, not a moment; "
          f"update it with the optimizer whose init made it (jaxlowbit.optim.make({self.format_name.split('(')[0]!r}"
          ", ...)), not an optax one")
    return tuple.__getitem__(self, index)

  return property(get, doc=f"the {name} codes (or float32 moments of small tensors), as the base class")


@functools.cache
def state_class(m_format: BlockFormat, v_format: BlockFormat) -> type[ScaleByAdamQuantizedState]:
  """The :class:`ScaleByAdamQuantizedState` subclass of one pair of moment formats (one class per pair).

  Its ``m_format``, ``v_format`` and ``format_name`` say what the codes are, so an optimizer refuses
  another's state by its type, at trace time. The fields, and so a checkpoint's layout, are those
  of :class:`ScaleByAdamQuantizedState`.
  """
  name = _format_name(m_format, v_format)
  return type("ScaleByAdamQuantizedState", (ScaleByAdamQuantizedState,), {
      "__slots__": (),
      "__qualname__": f"ScaleByAdamQuantizedState[{name}]",
      "m_format": m_format,
      "v_format": v_format,
      "format_name": name,
      # optax's updates may not read the codes as moments (above)
      "mu": _codes_field(ScaleByAdamQuantizedState._fields.index("mu"), "mu"),
      "nu": _codes_field(ScaleByAdamQuantizedState._fields.index("nu"), "nu"),
      # pickle and deepcopy find the class again from its formats (it is made at run time)
      "__reduce__": lambda self: (_rebuild_state, (self.m_format, self.v_format, tuple(self))),
  })  # fmt: skip


def _describe_state(state) -> str:
  """What an optimizer state given to ``update`` is, for an error message."""
  if isinstance(state, ScaleByAdamQuantizedState):
    return f"the state of {state.format_name}" if state.format_name else "a ScaleByAdamQuantizedState of no format"
  if isinstance(state, optax.ScaleByAdamState):
    return "the state of optax.adamw (optax.ScaleByAdamState)"
  return f"a {type(state).__name__}"


def _check_state(state, state_type: type[ScaleByAdamQuantizedState]) -> None:
  """TypeError unless ``state`` was made by an optimizer of ``state_type``'s formats."""
  if isinstance(state, (dict, list)):
    raise TypeError(
        f"{state_type.format_name}.update: got a {type(state).__name__} where its state belongs: an optimizer "
        "state restored without a target (orbax's restore(path) alone returns dicts and lists); restore with "
        "the target jax.eval_shape(tx.init, params)"
    )
  if type(state) is not state_type:
    raise TypeError(
        f"{state_type.format_name}.update: got {_describe_state(state)}, not a state of {state_type.format_name}; "
        f"an optimizer updates only the state its own init made (call {state_type.format_name}(...).init(params))"
    )


def _check_format(fmt: BlockFormat, moment: str, who: str) -> None:
  if not isinstance(fmt, BlockFormat):
    raise TypeError(f"{who}: {moment}_format must be a jaxlowbit.qstate.BlockFormat, got {fmt!r}")
  if moment == "m" and fmt.kind in ("dynamic", "linear") and not fmt.signed:
    raise ValueError(f"{who}: the first moment is signed; {fmt} cannot hold it")


def _scale_shape(shape: tuple[int, ...], block: int) -> tuple[int, ...]:
  return (*shape[:-1], -(-shape[-1] // block)) if shape else ()


def scale_by_adam_quantized(
    m_format: BlockFormat,
    v_format: BlockFormat,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
    *,
    nesterov: bool = False,
    min_size: int = MIN_QUANTIZED_SIZE,
    execution: ExecutionOptions | None = None,
) -> optax.GradientTransformation:
  """``optax.scale_by_adam`` with block-wise quantized moments.

  Args:
    m_format, v_format: storage of the first and second moments (``m`` needs a signed format).
    b1, b2, eps, eps_root, nesterov: as in ``optax.scale_by_adam``.
    mu_dtype: dtype of ``m`` for tensors that stay unquantized (as in optax); None: the
      parameter's dtype.
    min_size: tensors with fewer elements keep unquantized moments.
    execution: the backend of the quantized tensors' update (:class:`jaxlowbit.ExecutionOptions`: the
      fused kernel or XLA's, ``pallas_kernels.dispatch.adam_update``); None: ``$JAXLOWBIT_BACKEND``,
      read when the update is traced.

  Returns:
    An ``optax.GradientTransformation`` whose state is a :class:`ScaleByAdamQuantizedState`.
    Updates of quantized tensors are float32; the others follow ``optax.scale_by_adam`` exactly.
  """
  return _scale_by_adam_quantized(m_format, v_format, b1, b2, eps, eps_root, mu_dtype, nesterov, min_size,
                                  execution)[0]


def _scale_by_adam_quantized(m_format, v_format, b1, b2, eps, eps_root, mu_dtype, nesterov, min_size, execution=None):
  """:func:`scale_by_adam_quantized` and its step written into the parameters: ``(tx, step)`` with
  ``step(grads, state, params, neg_lr, weight_decay, seeds) -> (params, state)``, where
  ``neg_lr`` and ``weight_decay`` are trees of scalars and ``seeds`` of uint32 scalars (or Nones:
  round bf16 parameters to nearest), one per parameter."""
  who = "scale_by_adam_quantized"
  _check_format(m_format, "m", who)
  _check_format(v_format, "v", who)
  if m_format.block != v_format.block:
    raise ValueError(f"{who}: m and v must share one block size, got {m_format.block} and {v_format.block}")
  mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
  block = m_format.block
  state_type = state_class(m_format, v_format)

  def quantized(shape) -> bool:
    return math.prod(shape) >= min_size and blockable(shape, m_format) and blockable(shape, v_format)

  def init_fn(params):
    def moment(p, fmt, dtype):
      if quantized(p.shape):
        return zeros_blockwise(p.shape, fmt).codes
      return jnp.zeros(p.shape, dtype or p.dtype)

    def scale(p):  # zero scales of zero codes; ones for a moment kept in float32
      return jnp.full(_scale_shape(p.shape, block), 0.0 if quantized(p.shape) else 1.0, jnp.float32)

    return state_type(
        count=jnp.zeros([], jnp.int32),
        mu=jax.tree.map(lambda p: moment(p, m_format, mu_dtype), params),
        nu=jax.tree.map(lambda p: moment(p, v_format, None), params),
        mu_scale=jax.tree.map(scale, params),
        nu_scale=jax.tree.map(scale, params),
    )

  def run(updates, state, params=None, step=None):
    """``update`` (``step`` None: returns the updates), or the fused step (``step = (neg_lr,
    weight_decay, seeds)``, trees like the parameters: returns the new parameters)."""
    _check_state(state, state_type)
    count_inc = optax.safe_increment(state.count)
    coefficients = adam_coefficients(b1, b2, eps, eps_root, count_inc, optax.safe_increment(count_inc))
    kernels = None if execution is None else execution.dispatch()  # None: dispatch reads the environment

    def leaf(g, m, v, m_scale, v_scale, *p_step):
      """``p_step``: empty (update), or ``(p, neg_lr, weight_decay, seed)`` (fused step)."""
      if g is None:
        return None, m, v, m_scale, v_scale
      if quantized(g.shape):  # the fused kernel on a GPU, XLA's update elsewhere
        mq, vq = BlockQuantized(m, m_scale), BlockQuantized(v, v_scale)
        if p_step:
          p, neg_lr, weight_decay, seed = p_step
          out, (m_codes, m_scale), (v_codes, v_scale) = dispatch.adam_step(
              p, g, mq, vq, coefficients, neg_lr, weight_decay, seed, m_format, v_format, nesterov, kernels)
        else:
          out, (m_codes, m_scale), (v_codes, v_scale) = dispatch.adam_update(
              g, mq, vq, coefficients, m_format, v_format, nesterov, kernels)
        return out, m_codes, v_codes, m_scale, v_scale
      out, m_new, v_new = adam_moments(g, m, v, coefficients, nesterov)  # optax.scale_by_adam's arithmetic
      if p_step:
        p, neg_lr, weight_decay, seed = p_step
        bits = None if seed is None else flat_index_bits(p.shape, seed)
        out = apply_update(p, out, neg_lr, weight_decay, bits)
      if mu_dtype is not None:
        m_new = m_new.astype(mu_dtype)
      return out, m_new, v_new.astype(v.dtype), m_scale, v_scale

    trees = (updates, state.mu, state.nu, state.mu_scale, state.nu_scale)
    if step is not None:
      trees += (params, *step)
    out = jax.tree.map(leaf, *trees, is_leaf=lambda x: x is None)
    pick = lambda i: jax.tree.map(lambda _, o: o[i], updates, out, is_leaf=lambda x: x is None)  # noqa: E731
    return pick(0), state_type(count_inc, pick(1), pick(2), pick(3), pick(4))

  def update_fn(updates, state, params=None):
    del params
    return run(updates, state)

  step = lambda grads, state, params, neg_lr, weight_decay, seeds: run(  # noqa: E731
      grads, state, params, (neg_lr, weight_decay, seeds))
  return optax.GradientTransformation(init_fn, update_fn), step


def state_shardings(optimizer: optax.GradientTransformation, state, param_shardings, replicated=None, mesh=None):
  """The shardings of ``optimizer``'s ``state``, from its parameters' shardings.

  Every parameter-shaped leaf (optax's moments, this module's codes and block scales) takes its
  parameter's sharding; a dimension that its mesh axes do not divide in that leaf (the block
  scales of a small last axis) is left unsharded. Everything else (step counts,
  hyperparameters) gets ``replicated``.

  Args:
    optimizer: the optax transformation that made ``state``.
    state: its state, or ``jax.eval_shape`` of its ``init``.
    param_shardings: a tree like the parameters of ``NamedSharding`` s, or of ``PartitionSpec`` s
      with ``mesh``.
    replicated: what non-parameter leaves get (default: replicated, ``NamedSharding`` or
      ``PartitionSpec()`` like ``param_shardings``).
    mesh: the mesh of ``PartitionSpec`` shardings (read from ``NamedSharding`` s otherwise).

  Returns:
    A tree like ``state`` of the same kind of sharding.
  """

  def fit(leaf, sharding):
    spec, leaf_mesh = (sharding.spec, sharding.mesh) if isinstance(sharding, NamedSharding) else (sharding, mesh)
    if not isinstance(spec, PartitionSpec):
      raise TypeError(f"state_shardings: expected NamedSharding or PartitionSpec leaves, got {sharding!r}")
    entries = list(spec) + [None] * (len(leaf.shape) - len(spec))
    if leaf_mesh is not None:
      for dim, axes in enumerate(entries[: len(leaf.shape)]):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        if leaf.shape[dim] % math.prod(leaf_mesh.shape[name] for name in names):
          entries[dim] = None
    fitted = PartitionSpec(*entries[: len(leaf.shape)])
    return NamedSharding(sharding.mesh, fitted) if isinstance(sharding, NamedSharding) else fitted

  if replicated is None:
    named = [s.mesh for s in jax.tree.leaves(param_shardings) if isinstance(s, NamedSharding)]
    replicated = NamedSharding(named[0], PartitionSpec()) if named else PartitionSpec()
  return optax.tree_map_params(
      optimizer, fit, state, param_shardings, transform_non_params=lambda _: replicated,
      is_leaf=lambda x: isinstance(x, (NamedSharding, PartitionSpec)),
  )  # fmt: skip


def moment_formats(name: str, block_size: int | None = None) -> tuple[BlockFormat, BlockFormat]:
  """``(m_format, v_format)``: how the low-bit optimizer ``name`` stores its moments (the table above).

  Args:
    name: ``adamw_8bit``, ``adamw_4bit``, ``adamw_fp8`` or ``adamw_fp8_o2``.
    block_size: elements per block (None: the optimizer's default).
  """
  defaults = {"adamw_8bit": BLOCK_8BIT, "adamw_4bit": BLOCK_4BIT, "adamw_fp8": BLOCK_FP8, "adamw_fp8_o2": BLOCK_FP8}
  if name not in defaults:
    raise ValueError(f"moment_formats: {name!r} has no low-bit moments; choose one of {sorted(defaults)}")
  b = defaults[name] if block_size is None else block_size
  return {
      "adamw_8bit": (BlockFormat("dynamic", 8, True, b), BlockFormat("dynamic", 8, False, b, nonzero=True)),
      "adamw_4bit": (BlockFormat("dynamic", 4, True, b), BlockFormat("linear", 4, False, b, nonzero=True)),
      "adamw_fp8": (BlockFormat("e4m3", block=b), BlockFormat("e4m3", block=b, nonzero=True)),
      "adamw_fp8_o2": (BlockFormat("e4m3", block=b), BlockFormat("fp16", block=b, nonzero=True)),
  }[name]


class FusedStep(optax.GradientTransformationExtraArgs):
  """An optax transformation (``init``, ``update``) that can also write its step into the parameters.

  Attributes (set by this module's constructors; :func:`apply_step` reads them):
    fused_step: ``fused_step(grads, state, params, rounding_key=None) -> (params, state)``, equal
      to ``optax.apply_updates(params, update(grads, state, params)[0])`` up to float32 rounding
      (bf16 parameters: rounded stochastically when ``rounding_key`` is given); None if it has none.
    rounding: for :func:`stochastic_rounding` only, ``rounding(state) -> (key, state)``: the key
      of this step and the advanced state.
  """

  fused_step = None
  rounding = None


def _fused(tx, **attributes) -> FusedStep:
  out = FusedStep(tx.init, tx.update)
  for name, value in attributes.items():
    setattr(out, name, value)
  return out


def _scalar(x: jax.Array) -> jax.Array:
  """The value of a tree leaf that optax filled with one scalar (see :func:`_adamw`)."""
  return x.reshape(-1)[0] if x.size else jnp.zeros((), x.dtype)


def _adamw(moments, weight_decay: optax.ScalarOrSchedule, mask, learning_rate) -> FusedStep:
  """``optax.chain(adam, add_decayed_weights, scale_by_learning_rate)`` as ``optax.adamw`` builds it,
  with its fused step: the chain's state and schedules advance as in ``update``, and each
  parameter's ``-learning_rate`` and weight decay (0 where ``mask`` says no) are read from optax's
  own transformations, applied to probes of ones (under jit XLA folds them to scalars)."""
  adam, adam_step = moments
  decay = optax.add_decayed_weights(weight_decay, mask)
  scale = optax.scale_by_learning_rate(learning_rate)
  tx = optax.chain(adam, decay, scale)

  def fused_step(grads, state, params, rounding_key=None):
    adam_state, decay_state, scale_state = state
    ones = jax.tree.map(lambda p: jnp.broadcast_to(jnp.float32(1), p.shape), params)
    zeros = jax.tree.map(jnp.zeros_like, ones)
    decays, decay_state = decay.update(zeros, decay_state, ones)
    neg_lrs, scale_state = scale.update(ones, scale_state, ones)
    leaves, treedef = jax.tree.flatten(params)
    if rounding_key is None:
      seeds = [None] * len(leaves)
    else:
      seeds = list(jax.random.bits(rounding_key, (len(leaves),), jnp.uint32))
    params, adam_state = adam_step(grads, adam_state, params, jax.tree.map(_scalar, neg_lrs),
                                   jax.tree.map(_scalar, decays), jax.tree.unflatten(treedef, seeds))
    return params, (adam_state, decay_state, scale_state)

  return _fused(tx, fused_step=fused_step)


def chain(*transforms: optax.GradientTransformation) -> FusedStep:
  """``optax.chain`` (the same state) that keeps a fused step: when the last transformation has
  one (this module's optimizers), or is :func:`stochastic_rounding` after one, :func:`apply_step`
  runs the others' ``update`` on the gradients and then that fused step.

  E.g. ``chain(optax.clip_by_global_norm(1.0), adamw_8bit(3e-4))``.
  """
  tx = optax.chain(*transforms)
  *head, last = transforms
  rounding = getattr(last, "rounding", None)
  if rounding is not None and head:
    *head, last = head
  step = getattr(last, "fused_step", None)
  if step is None:
    return _fused(tx)
  n = len(head)

  def fused_step(grads, state, params, rounding_key=None):
    new_state = []
    for t, s in zip(head, state[:n]):
      grads, s = optax.with_extra_args_support(t).update(grads, s, params)
      new_state.append(s)
    rest = state[n + 1:]
    if rounding is not None:
      rounding_key, rounding_state = rounding(rest[0])
      rest = (rounding_state,)
    params, s = step(grads, state[n], params, rounding_key)
    return params, (*new_state, s, *rest)

  return _fused(tx, fused_step=fused_step)


def apply_step(optimizer: optax.GradientTransformation, grads, state, params) -> tuple[optax.Params, optax.OptState]:
  """One optimizer step into the parameters: ``(new params, new state)``.

  ``optax.apply_updates(params, optimizer.update(grads, state, params)[0])`` for any optax
  transformation. This module's optimizers (and :func:`chain` s ending in one) take their fused
  step instead: on a GPU each block-wise quantized tensor is one kernel that reads the gradient,
  the moments and the parameter and writes the new moments and parameter (no update tensor in
  between); elsewhere the same arithmetic in XLA. The results agree with the unfused step to
  float32 rounding; bf16 parameters after :func:`stochastic_rounding` are rounded stochastically
  in both, from different random bits.
  """
  if getattr(optimizer, "fused_step", None) is not None:
    return optimizer.fused_step(grads, state, params)
  updates, state = optimizer.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def adamw_quantized(
    m_format: BlockFormat,
    v_format: BlockFormat,
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    *,
    nesterov: bool = False,
    min_size: int = MIN_QUANTIZED_SIZE,
    execution: ExecutionOptions | None = None,
) -> FusedStep:
  """AdamW with moments stored in any block formats: what :func:`adamw_8bit`, :func:`adamw_4bit` and
  :func:`adamw_fp8` build with theirs (:func:`moment_formats`).

  Args:
    m_format, v_format: the moments' :class:`~jaxlowbit.qstate.BlockFormat` s (one block size).
    learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask, nesterov: as in ``optax.adamw``.
    min_size: tensors with fewer elements keep float32 moments.
    execution: the backend of the update (:func:`scale_by_adam_quantized`); None: the environment's.

  Returns:
    A :class:`FusedStep`: ``optax.chain(scale_by_adam_quantized, add_decayed_weights,
    scale_by_learning_rate)``, like ``optax.adamw``, with its fused step (:func:`apply_step`).
  """
  moments = _scale_by_adam_quantized(m_format, v_format, b1, b2, eps, eps_root, mu_dtype, nesterov, min_size,
                                     execution)
  return _adamw(moments, weight_decay, mask, learning_rate)


def _static(value, default: int, name: str, who: str) -> int:
  """A static int argument (None: ``default``); a traced or array value gets a clear error."""
  if value is None:
    return default
  if isinstance(value, (jax.Array, np.ndarray)):
    raise TypeError(
        f"{who}: {name} is static (it fixes the state's shapes) but got an array; under "
        f"optax.inject_hyperparams list it in static_args=({name!r},) or leave it at its default"
    )
  if not isinstance(value, int) or isinstance(value, bool):
    raise TypeError(f"{who}: {name} must be an int (default {default}), got {value!r}")
  return value


def _check_block(block_size, who: str, default: int) -> int:
  block_size = _static(block_size, default, "block_size", who)
  if block_size < 2 or block_size % 2:
    raise ValueError(f"{who}: block_size must be an even int >= 2 (default {default}), got {block_size!r}")
  return block_size


def adamw_8bit(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    *,
    nesterov: bool = False,
    block_size: int | None = None,
    min_size: int | None = None,
    execution: ExecutionOptions | None = None,
) -> FusedStep:
  """``optax.adamw`` with 8-bit block-wise moments (dynamic tree map; bitsandbytes' 8-bit Adam).

  Args:
    learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask, nesterov: as in
      ``optax.adamw`` (``mu_dtype`` applies to the tensors that stay unquantized).
    block_size: elements per block and scale (even; None: 256 as in bitsandbytes and torchao).
    min_size: tensors with fewer elements keep float32 moments (None: 4096).
    execution: the backend of the update (:func:`scale_by_adam_quantized`); None: the environment's.

  Returns:
    A :class:`FusedStep` (an optax chain, like ``optax.adamw``'s, with a fused step: :func:`apply_step`).
  """
  block_size = _check_block(block_size, "adamw_8bit", BLOCK_8BIT)
  min_size = _static(min_size, MIN_QUANTIZED_SIZE, "min_size", "adamw_8bit")
  return adamw_quantized(*moment_formats("adamw_8bit", block_size), learning_rate, b1, b2, eps, eps_root, mu_dtype,
                         weight_decay, mask, nesterov=nesterov, min_size=min_size, execution=execution)


def adamw_4bit(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    *,
    nesterov: bool = False,
    block_size: int | None = None,
    min_size: int | None = None,
    execution: ExecutionOptions | None = None,
) -> FusedStep:
  """``optax.adamw`` with 4-bit block-wise moments, two codes per byte (torchao's 4-bit AdamW).

  ``m`` uses the signed 4-bit dynamic map, ``v`` the linear map without zero (Li et al. 2023:
  a second moment rounded to zero would blow the update up).

  Args:
    learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask, nesterov: as in
      ``optax.adamw``.
    block_size: elements per block and scale (even; None: 128 as in Li et al. 2023 and torchao).
    min_size: tensors with fewer elements keep float32 moments (None: 4096).
    execution: the backend of the update (:func:`scale_by_adam_quantized`); None: the environment's.

  Returns:
    A :class:`FusedStep`.
  """
  block_size = _check_block(block_size, "adamw_4bit", BLOCK_4BIT)
  min_size = _static(min_size, MIN_QUANTIZED_SIZE, "min_size", "adamw_4bit")
  return adamw_quantized(*moment_formats("adamw_4bit", block_size), learning_rate, b1, b2, eps, eps_root, mu_dtype,
                         weight_decay, mask, nesterov=nesterov, min_size=min_size, execution=execution)


def adamw_fp8(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    *,
    nesterov: bool = False,
    v_dtype: Any = None,
    block_size: int | None = None,
    min_size: int | None = None,
    execution: ExecutionOptions | None = None,
) -> FusedStep:
  """``optax.adamw`` with FP8 moments: e4m3 with a block scale ``amax / 448`` (torchao's FP8 AdamW).

  ``v_dtype=jnp.float16`` gives MS-AMP's O2 optimizer: ``m`` e4m3, ``v`` float16 (block scale
  ``amax / 65504``), which keeps the second moment's wide dynamic range: e4m3 spans only
  ~2e5 between a block's largest and smallest nonzero value, and ``v ~ g^2`` squares the
  range of the gradients.

  Args:
    learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask, nesterov: as in
      ``optax.adamw``.
    v_dtype: ``jnp.float8_e4m3fn`` (None, the default) or ``jnp.float16`` (MS-AMP O2).
    block_size: elements per block and scale (even; None: 256 as in torchao).
    min_size: tensors with fewer elements keep float32 moments (None: 4096).
    execution: the backend of the update (:func:`scale_by_adam_quantized`); None: the environment's.

  Returns:
    A :class:`FusedStep`.
  """
  block_size = _check_block(block_size, "adamw_fp8", BLOCK_FP8)
  min_size = _static(min_size, MIN_QUANTIZED_SIZE, "min_size", "adamw_fp8")
  names = {jnp.dtype(fp8.E4M3): "adamw_fp8", jnp.dtype(jnp.float16): "adamw_fp8_o2"}
  try:
    name = names[jnp.dtype(fp8.E4M3 if v_dtype is None else v_dtype)]
  except (KeyError, TypeError):
    raise TypeError(
        f"adamw_fp8: v_dtype must be jnp.float8_e4m3fn or jnp.float16 (MS-AMP O2), got {v_dtype!r}"
    ) from None
  return adamw_quantized(*moment_formats(name, block_size), learning_rate, b1, b2, eps, eps_root, mu_dtype,
                         weight_decay, mask, nesterov=nesterov, min_size=min_size, execution=execution)


def adamw_fp8_o2(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    *,
    nesterov: bool = False,
    block_size: int | None = None,
    min_size: int | None = None,
    execution: ExecutionOptions | None = None,
) -> optax.GradientTransformationExtraArgs:
  """MS-AMP O2's optimizer: :func:`adamw_fp8` with ``v_dtype=jnp.float16`` (``m`` e4m3, ``v`` float16).

  Arguments as :func:`adamw_fp8` (spelled out, so ``optax.inject_hyperparams`` sees them).
  """
  return adamw_fp8(
      learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask,
      nesterov=nesterov, v_dtype=jnp.float16, block_size=block_size, min_size=min_size, execution=execution,
  )  # fmt: skip


# ----------------------------------------------------------------------------- bf16 weights


def _leaf_keys(key: jax.Array, tree) -> Any:
  """One independent key per leaf of ``tree`` (fold_in of the leaf's index)."""
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, [jax.random.fold_in(key, i) for i in range(len(leaves))])


def _needs_rounding(p) -> bool:
  return p is not None and jnp.dtype(p.dtype) == jnp.bfloat16


def apply_updates_stochastic(params: optax.Params, updates: optax.Updates, key: jax.Array) -> optax.Params:
  """``optax.apply_updates`` that rounds bfloat16 parameters stochastically.

  bf16 leaves become ``stochastic_round(float32(p) + float32(u))`` (unbiased: the expected new
  weight is the exact sum), so a model trains in bf16 with no float32 master copy. Other
  leaves are updated as ``optax.apply_updates`` does.

  Args:
    params: tree of arrays (any float dtypes).
    updates: tree of the same structure (any float dtypes).
    key: ``jax.random`` key; each leaf uses ``fold_in(key, leaf index)``.

  Returns:
    The new parameters, each in its old dtype.
  """
  keys = _leaf_keys(key, params)

  def apply(p, u, k):
    if p is None:
      return None
    if _needs_rounding(p):
      return stochastic_round(p.astype(jnp.float32) + u.astype(jnp.float32), k, jnp.bfloat16)
    return jnp.asarray(p + u).astype(jnp.asarray(p).dtype)

  return jax.tree.map(apply, params, updates, keys, is_leaf=lambda x: x is None)


class StochasticRoundingState(NamedTuple):
  """State of :func:`stochastic_rounding`: ``key`` is raw ``uint32`` key data (checkpointable)."""

  key: jax.Array


def stochastic_rounding(seed: int | jax.Array = 0) -> optax.GradientTransformation:
  """Last transformation of a chain: makes ``optax.apply_updates`` round bf16 params stochastically.

  For each bfloat16 parameter it returns the float32 update ``u' = stochastic_round(p + u) - p``.
  Both terms are bf16 values, so ``u'`` is exact in float32 (unless ``p + u`` cancels to below
  ``2^-24 |p|``, where the result is off by less than float32's resolution at ``p``), and
  ``optax.apply_updates`` (which adds in float32 and casts back) lands on the stochastically
  rounded value. Other parameters pass their updates through. Needs ``params`` in ``update``;
  put nothing after it.

  Args:
    seed: int seed or a ``jax.random`` key; the state carries the key (as uint32 key data) and
      advances it every step, so a restored checkpoint continues the same random stream.

  Returns:
    An ``optax.GradientTransformation``.
  """
  if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
    seed = jax.random.key(int(seed))
  elif not (isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key) and seed.shape == ()):
    raise TypeError(f"stochastic_rounding: seed must be an int or a typed jax.random.key (one key), got {seed!r}")
  key_data = jax.random.key_data(seed)
  impl = jax.random.key_impl(seed)

  def init_fn(params):
    del params
    return StochasticRoundingState(key=key_data)

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("stochastic_rounding: update needs params (tx.update(grads, state, params))")
    step_key, new_state = rounding(state)
    new = apply_updates_stochastic(params, updates, step_key)

    def delta(p, u, n):
      if not _needs_rounding(p):
        return u
      return n.astype(jnp.float32) - p.astype(jnp.float32)

    out = jax.tree.map(delta, params, updates, new, is_leaf=lambda x: x is None)
    return out, new_state

  def rounding(state):
    key, step_key = jax.random.split(jax.random.wrap_key_data(state.key, impl=impl))
    return step_key, StochasticRoundingState(key=jax.random.key_data(key))

  return _fused(optax.GradientTransformation(init_fn, update_fn), rounding=rounding)


# ----------------------------------------------------------------------------- factory


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any | None = None,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: Any | Callable[[optax.Params], Any] | None = None,
    *,
    nesterov: bool = False,
    execution: ExecutionOptions | None = None,
) -> optax.GradientTransformationExtraArgs:
  """``optax.adamw`` (same arguments, state and arithmetic) whose ``update`` refuses a low-bit state.

  optax's own ``update`` reads a low-bit state's codes as moments without a word (both name them
  ``mu`` and ``nu``); this one, :data:`OPTIMIZERS`' ``adamw``, says whose state it got instead.
  ``execution`` is accepted so that every optimizer of :data:`OPTIMIZERS` takes the same arguments;
  optax's update runs no kernel of ours, so it changes nothing.
  """
  del execution
  tx = optax.adamw(learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask, nesterov=nesterov)

  def update_fn(updates, state, params=None, **extra_args):
    first = state[0] if isinstance(state, tuple) and state else state
    if isinstance(first, ScaleByAdamQuantizedState):
      raise TypeError(f"adamw.update: got {_describe_state(first)}, not a state of optax.adamw; an optimizer "
                      "updates only the state its own init made (call adamw(...).init(params))")
    return tx.update(updates, state, params, **extra_args)

  return optax.GradientTransformationExtraArgs(tx.init, update_fn)


OPTIMIZERS: dict[str, Callable[..., optax.GradientTransformation]] = {
    "adamw": adamw,
    "adamw_8bit": adamw_8bit,
    "adamw_4bit": adamw_4bit,
    "adamw_fp8": adamw_fp8,
    "adamw_fp8_o2": adamw_fp8_o2,
}


def make(
    name: str, learning_rate: optax.ScalarOrSchedule, *, stochastic_rounding_seed: int | None = None, **kwargs
) -> optax.GradientTransformation:
  """An AdamW by name: ``adamw`` (optax's, see :func:`adamw`), ``adamw_8bit``, ``adamw_4bit``, ``adamw_fp8``,
  ``adamw_fp8_o2``.

  Args:
    name: one of :data:`OPTIMIZERS`.
    learning_rate: float or optax schedule.
    stochastic_rounding_seed: if not None, chain :func:`stochastic_rounding` (bf16 params are
      rounded stochastically by ``optax.apply_updates``).
    **kwargs: the optimizer's other arguments (``b1``, ``b2``, ``weight_decay``, ``mask``, ``execution``:
      the backend of the low-bit update, :class:`jaxlowbit.ExecutionOptions`, ...).

  Returns:
    An ``optax.GradientTransformation``.
  """
  try:
    factory = OPTIMIZERS[name]
  except KeyError:
    raise ValueError(f"jaxlowbit.optim.make: unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}") from None
  tx = factory(learning_rate, **kwargs)
  if stochastic_rounding_seed is not None:
    tx = chain(tx, stochastic_rounding(stochastic_rounding_seed))
  return tx


__all__ = [
    "BLOCK_4BIT",
    "BLOCK_8BIT",
    "BLOCK_FP8",
    "FusedStep",
    "MIN_QUANTIZED_SIZE",
    "OPTIMIZERS",
    "ScaleByAdamQuantizedState",
    "StochasticRoundingState",
    "adamw",
    "adamw_4bit",
    "adamw_8bit",
    "adamw_fp8",
    "adamw_fp8_o2",
    "adamw_quantized",
    "apply_step",
    "apply_updates_stochastic",
    "chain",
    "make",
    "moment_formats",
    "state_class",
    "scale_by_adam_quantized",
    "state_shardings",
    "stochastic_rounding",
]
