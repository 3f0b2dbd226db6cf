"""Peer rows: the same model and data trained through the JAX quantization libraries a user could pick instead.

Every peer takes our bf16 model (``train.model.Transformer`` with ``recipe=None``), keeps its parameters
(same names, shapes and init) and quantizes the same projections a jaxlowbit recipe would under the
config's switches (``quantize_attention``, ``quantize_mlp``, ``quantize_lm_head``, ``filter_fqns``;
by default every attention and MLP projection, not the LM head), forward and backward:

==============  ===========================================================================================
``qwix_int8``   Qwix quantized training (``qwix.QtProvider`` + ``qwix.quantize_model``): weights, activations
                and gradients int8 (Qwix's default absmax calibration, per-channel scales).
``qwix_fp8``    the same with weights and activations ``float8_e4m3fn``, gradients ``float8_e5m2``.
``flax_fp8``    Flax's FP8 op ``nn.Fp8DirectDotGeneralOp`` as each projection's ``dot_general`` (what
                ``nn.DenseGeneral(dot_general_cls=nn.Fp8DirectDotGeneralOp)`` runs): per-tensor delayed
                scaling (amax history), e4m3 inputs and weights, e5m2 gradients.
==============  ===========================================================================================

Qwix is optional (``pip install qwix``): :func:`missing` names what a peer needs that is not
installed, and the benchmarks skip that row with a note. Peers run on one device (no FSDP).

``step_functions(spec, name)`` gives the peer's :class:`train.steps.StepFunctions`: the Qwix rows run
the trainer's own step (``train.steps.make_train_step``) on the Qwix-quantized model; the Flax FP8
row needs its scales carried between steps (Flax keeps them in the ``_overwrite_with_gradient``
collection, whose "gradient" is the next value), so its step is the trainer's with that collection
threaded through (held in ``TrainState.scales``, otherwise unused on one device).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxlowbit import Int8MixedPrecision
from jaxlowbit.interception import PASS, dense_interceptor, intercepted_copy
from jaxlowbit.layers import dense_general
from train.model import ModelConfig, Transformer, projection_paths
from train.optimizer import make_optimizer
from train.runtime import Unsharded, cross_entropy
from train.spec import RunSpec
from train.steps import StepFunctions, TrainState, make_eval_step, make_init, make_train_step

PEERS = ("qwix_int8", "qwix_fp8", "flax_fp8")
# (weights and activations, gradients) of each Qwix row: e4m3 forward and e5m2 backward is the usual FP8
# training split (Micikevicius et al. 2022; Transformer Engine, torchao tensorwise, our fp8_tensorwise).
QWIX_QTYPES = {"qwix_int8": (jnp.int8, jnp.int8), "qwix_fp8": (jnp.float8_e4m3fn, jnp.float8_e5m2)}
# The Flax collection that holds the FP8 scales and amax histories (flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT):
# the gradient that jax.grad returns for it is the variables' next value.
FP8_META = "_overwrite_with_gradient"
LAYER_INDEX = re.compile(r"^layers_\d+")  # unrolled layers are layers_<i>; the scan's and the configs' "layers"


def missing(name: str) -> str | None:
  """What peer ``name`` needs that is not installed (a note to print), or None when it can run."""
  if name not in PEERS:
    raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
  if name.startswith("qwix") and importlib.util.find_spec("qwix") is None:
    return f"{name}: skipped, qwix is not installed (pip install qwix==0.1.8)"
  return None


def quantized_projections(config: ModelConfig) -> tuple[str, ...]:
  """The projection paths (``"layers.mlp.down"``, ``"lm_head"``) a jaxlowbit recipe quantizes under
  ``config``'s switches: the ones every peer quantizes too (any recipe answers the same; INT8 adds no norms)."""
  probe = dataclasses.replace(config, recipe=Int8MixedPrecision(), tie_embeddings=False)
  return tuple(path for path in projection_paths(probe) if probe.recipe_for(path) is not None)


def qwix_rules(name: str, config: ModelConfig) -> list:
  """The ``qwix.QtRule`` of a Qwix row: its dtypes on the dot_general of every quantized projection."""
  import qwix  # optional: only the Qwix rows need it

  weights_and_acts, grads = QWIX_QTYPES[name]
  # Qwix matches "/"-joined module paths in full: layers/mlp/down (scan) or layers_<i>/mlp/down.
  paths = [re.escape(p).replace(r"\.", "/").replace("layers/", r"layers(_\d+)?/", 1)
           for p in quantized_projections(config)]
  return [qwix.QtRule(module_path="|".join(paths), op_names=("dot_general",), weight_qtype=weights_and_acts,
                      act_qtype=weights_and_acts, bwd_qtype=grads)]


def _flax_fp8_handler(projections: tuple[str, ...]):
  """Interceptor handler: a quantized projection's Dense body with Flax's FP8 op as its dot_general."""

  def handler(module: nn.Module, inputs, path: str):
    if LAYER_INDEX.sub("layers", path) not in projections:
      return PASS

    def matmul(call, inputs, kernel):
      # Created inside the Dense's compact call, as DenseGeneral(dot_general_cls=...) creates it: a child
      # named Fp8DirectDotGeneralOp_0 whose scales live in the FP8_META collection. Kernel in the compute
      # dtype, as DenseGeneral promotes it (Flax's op takes that dtype as its compute dtype).
      op = nn.Fp8DirectDotGeneralOp()
      return op(inputs, jnp.asarray(kernel, call.dtype), call.dimension_numbers)

    return dense_general(module, inputs, matmul)

  return handler


def peer_model(name: str, model: Transformer) -> nn.Module:
  """``model`` (unbound, ``recipe=None``) with peer ``name`` quantizing its projections; same parameter tree."""
  config = model.config
  if config.recipe is not None:
    raise ValueError(f"peer {name}: takes the bf16 model (recipe None), got recipe {config.recipe!r}")
  note = missing(name)
  if note:
    raise ImportError(note)
  if name.startswith("qwix"):
    import qwix

    return qwix.quantize_model(model, qwix.QtProvider(qwix_rules(name, config)))
  if config.scan_layers:
    raise ValueError("peer flax_fp8: Flax's FP8 op keeps its scales in the '_overwrite_with_gradient' collection, "
                     "which train.model's layer scan does not carry; run it with model.scan_layers=False "
                     "(the 1B and 8B configs' setting)")
  return intercepted_copy(model, dense_interceptor(_flax_fp8_handler(quantized_projections(config))), "flax_fp8")


class Fp8MetaRuntime(Unsharded):
  """One device, for a model with Flax FP8 ops: ``scales`` is their ``FP8_META`` collection (initial value)."""

  def scales(self, params):
    del params  # Flax initializes the scales to 1 and the histories to 0, whatever the parameters
    return self.model.init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))[FP8_META]

  def loss_and_meta_grads(self, params, meta, tokens: jax.Array, rng: jax.Array | None):
    """``(loss, (grads, next_meta))`` of one microbatch ``tokens [b, T + 1]``."""

    def loss(params, meta):
      rngs = {"dropout": rng} if rng is not None and self.model.config.dropout_rate else {}
      logits = self.model.apply({"params": params, FP8_META: meta}, tokens[:, :-1], rngs=rngs)
      return cross_entropy(logits, tokens[:, 1:])

    return jax.value_and_grad(loss, argnums=(0, 1))(params, meta)

  def loss(self, params, scales, tokens: jax.Array) -> jax.Array:
    return self.loss_and_meta_grads(params, scales, tokens, None)[0]


def make_fp8_meta_train_step(runtime: Fp8MetaRuntime, optimizer: optax.GradientTransformation, spec: RunSpec):
  """``train.steps.make_train_step`` with the FP8 scales (``state.scales``) threaded through the microbatches:
  each microbatch reads the scales the previous one left (as a Flax user's loop would), the step keeps the last."""
  accum = spec.grad_accum_steps

  def train_step(state: TrainState, batch: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
    rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    if accum == 1:
      loss, (grads, meta) = runtime.loss_and_meta_grads(state.params, state.scales, batch, rng)
    else:
      def add_microbatch(carry, xs):
        meta, sums = carry
        index, tokens = xs
        loss, (grads, meta) = runtime.loss_and_meta_grads(state.params, meta, tokens, jax.random.fold_in(rng, index))
        return (meta, jax.tree.map(jnp.add, sums, (loss, grads))), None

      zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state.params))
      (meta, (loss, grads)), _ = jax.lax.scan(add_microbatch, (state.scales, zeros),
                                              (jnp.arange(accum), runtime.microbatches(batch, accum)))
      loss, grads = jax.tree.map(lambda x: x / accum, (loss, grads))
    grad_norm = optax.tree.norm(grads)
    params, opt_state, _ = runtime.apply_update(optimizer, grads, state.opt_state, state.params)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, scales=meta)
    return new_state, {"loss": loss, "grad_norm": grad_norm}

  return train_step


def step_functions(spec: RunSpec, name: str) -> StepFunctions:
  """The jitted init and step of peer ``name`` on ``spec``'s bf16 model (one device), as the trainer builds its own."""
  if spec.mesh.devices != 1:
    raise ValueError(f"peer {name}: runs on one device; got a mesh of {spec.mesh.devices} (set mesh.fsdp=1)")
  model = peer_model(name, Transformer(spec.model))
  optimizer = make_optimizer(spec)
  if name == "flax_fp8":
    runtime = Fp8MetaRuntime(model)
    train_step = make_fp8_meta_train_step(runtime, optimizer, spec)
  else:
    runtime = Unsharded(model)
    train_step = make_train_step(runtime, optimizer, spec)
  return StepFunctions(runtime, jax.jit(make_init(runtime, optimizer, spec)), jax.jit(train_step, donate_argnums=0),
                       jax.jit(make_eval_step(runtime)), None, spec.grad_accum_steps)


# ---------------------------------------------------------------------------------------------
# The MLP layer stack of benchmarks/layer.py: ``x + down(silu(gate x) * up x)`` per block.


class MlpStack(nn.Module):
  """``blocks`` SwiGLU blocks of ``nn.DenseGeneral`` (no bias; ``dot_general_cls`` for Flax's FP8 op).

  Parameters ``blocks_<i>/{gate,up,down}/kernel``: ``[D, H]``, ``[D, H]``, ``[H, D]``.
  """

  blocks: int
  hidden: int
  dtype: Any = jnp.bfloat16
  dot_general_cls: Any = None

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """``x [T, D]`` -> ``[T, D]`` (dtype)."""
    for i in range(self.blocks):
      def dense(features, name, i=i):
        return nn.DenseGeneral(features, use_bias=False, dtype=self.dtype, param_dtype=self.dtype,
                               dot_general_cls=self.dot_general_cls, name=f"blocks_{i}_{name}")

      x = x + dense(x.shape[-1], "down")(nn.silu(dense(self.hidden, "gate")(x)) * dense(self.hidden, "up")(x))
    return x


def mlp_stack_step(name: str, params: list[tuple[jax.Array, jax.Array, jax.Array]], x: jax.Array):
  """Peer ``name``'s jitted ``step(params, x, cot) -> (out, (grads, dx))`` of benchmarks/layer.py's stack.

  ``params``: ``[(w_gate [D, H], w_up [D, H], w_down [H, D])]`` per block (only their shapes are read here);
  grads in that structure, like layer.py's own step. Flax FP8's scales are differentiated too (their next
  value, as in training) and start from their init.
  """
  note = missing(name)
  if note:
    raise ImportError(note)
  hidden = params[0][0].shape[1]
  module = MlpStack(len(params), hidden, x.dtype, nn.Fp8DirectDotGeneralOp if name == "flax_fp8" else None)
  if name.startswith("qwix"):
    import qwix

    weights_and_acts, grads = QWIX_QTYPES[name]
    module = qwix.quantize_model(module, qwix.QtProvider([qwix.QtRule(
        op_names=("dot_general",), weight_qtype=weights_and_acts, act_qtype=weights_and_acts, bwd_qtype=grads)]))
  meta = module.init(jax.random.key(0), x).get(FP8_META, {})

  def tree(params):
    return {f"blocks_{i}_{part}": {"kernel": w} for i, ws in enumerate(params)
            for part, w in zip(("gate", "up", "down"), ws)}

  def loss(params, x, meta, cot):
    out = module.apply({"params": tree(params), FP8_META: meta} if meta else {"params": tree(params)}, x)
    return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32)), out

  def step(params, x, cot):
    (_, out), (grads, dx, _) = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(params, x, meta, cot)
    return out, (grads, dx)

  return jax.jit(step)


__all__ = [
    "FP8_META", "PEERS", "Fp8MetaRuntime", "MlpStack", "make_fp8_meta_train_step", "missing", "mlp_stack_step",
    "peer_model", "qwix_rules", "quantized_projections", "step_functions",
]
