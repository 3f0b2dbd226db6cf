"""The BitNet b1.58 model forms in the trainer: norm placement, squared-ReLU MLP, tied embeddings.

- ``--config.model.bitnet_norm_placement`` and ``--config.model.mlp_activation`` parse from the
  command line, ``configs/bitnet_*.py`` ship the published 2B4T form, bad names are a ConfigError
  naming the choices;
- each form trains a few steps with the trainer and checkpoints; the run's config.json records the
  choice, ``generate.load_run`` rebuilds the same model from the run directory alone, and a resumed
  run continues the uninterrupted one exactly;
- how often the train step quantizes each BitNet weight to ternary, counted in its jaxpr.
"""

import collections
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_train_loop
from helpers import equations, record_measured_quantizations
from test_train_config import _parse
from test_train_loop import micro_config, train_losses
from jaxlowbit import BitNet
from train import config as train_config
from train import generate, loop, steps
from train.model import Transformer, projection_paths
from train.optimizer import make_optimizer
from train.runtime import Unsharded
from train.spec import UNSHARDED, build
from pallas_kernels import policy

corpus = test_train_loop.corpus  # its module-scoped fixture (generated text), here for this module
CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


def test_command_line_chooses_the_bitnet_form():
  shipped = train_config.model_config(_parse([f"--config={CONFIGS / 'bitnet_1b.py'}"]))
  assert shipped.recipe == BitNet(grad_input=True, grad_weight=True)  # both backward matmuls in int8
  assert shipped.bitnet_norm_placement == "sub" and shipped.tie_embeddings and shipped.mlp_activation == "silu"
  config = _parse([f"--config={CONFIGS / 'tiny.py'}", "--config.recipe=bitnet",
                   "--config.model.bitnet_norm_placement=sub", "--config.model.mlp_activation=relu2"])
  train_config.check(config)
  model = train_config.model_config(config)
  assert model.bitnet_norm_placement == "sub" and model.mlp_activation == "relu2"
  default = train_config.model_config(_parse([f"--config={CONFIGS / 'tiny.py'}", "--config.recipe=bitnet"]))
  assert default.bitnet_norm_placement == "every_projection" and default.mlp_activation == "silu"


@pytest.mark.parametrize("field, bad, choices", [
    ("bitnet_norm_placement", "subnorm", r"\('sub', 'every_projection'\)"),
    ("mlp_activation", "gelu", r"\('silu', 'relu2'\)"),
])
def test_bad_names_are_config_errors_naming_the_choices(field, bad, choices):
  config = train_config.load_file(CONFIGS / "bitnet_125m.py")
  config.model[field] = bad
  with pytest.raises(train_config.ConfigError, match=f"{field}='{bad}'; choose one of {choices}"):
    train_config.check(config)


# (bitnet_norm_placement, mlp_activation, tie_embeddings): the published 2B4T form, and today's default.
FORMS = [("sub", "relu2", True), ("every_projection", "silu", False)]
FORM_STEPS = 4


@pytest.mark.parametrize("placement, activation, tied", FORMS, ids=str)
def test_each_bitnet_form_trains_checkpoints_and_reloads(placement, activation, tied, corpus, tmp_path):
  config = micro_config(corpus, recipe="bitnet", steps=FORM_STEPS, checkpoint_every=2, eval_every=2,
                        model__bitnet_norm_placement=placement, model__mlp_activation=activation,
                        model__tie_embeddings=tied)
  full = loop.train(config, tmp_path / "full")
  assert full.status == "completed" and full.step == FORM_STEPS
  losses = train_losses(tmp_path / "full")
  assert all(np.isfinite(list(losses.values()))) and losses[FORM_STEPS] < losses[1], losses

  recorded = json.loads((tmp_path / "full" / "config.json").read_text())["model"]
  assert (recorded["bitnet_norm_placement"], recorded["mlp_activation"], recorded["tie_embeddings"]) == (
      placement, activation, tied)
  _, model_config, params, step = generate.load_run(tmp_path / "full")
  assert step == FORM_STEPS and model_config == train_config.model_config(config)
  spec = build(config, UNSHARDED)
  abstract = jax.eval_shape(steps.make_init(Unsharded(Transformer(model_config)), make_optimizer(spec), spec))
  assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == jax.tree.map(lambda x: (x.shape, x.dtype),
                                                                            abstract.params)
  norms = {name for name in params["layers"]["attn"] | params["layers"]["mlp"] if name.endswith("_norm")}
  assert norms == ({"out_norm", "down_norm"} if placement == "sub" else {"qkv_norm", "out_norm", "gate_up_norm",
                                                                            "down_norm"})
  assert ("lm_head" in params) != tied

  stopped = loop.train(config, tmp_path / "split", should_stop=lambda step: step == 2)
  assert stopped.status == "interrupted" and stopped.checkpoint_step == 2
  config.resume = True
  assert loop.train(config, tmp_path / "split").step == FORM_STEPS
  assert train_losses(tmp_path / "split") == losses  # bit for bit


# ---------------------------------------------------------------------------------------------
# Ternary weight quantization per optimizer step, counted in the train step's jaxpr.
#
# A BitNet weight W [K, N] is quantized as ``round(W / mean|W|)`` (jaxlowbit_numerics.ternary), so
# each quantization is one ``round`` whose operand has W's shape. Each weight is quantized once per
# optimizer step: the forward keeps its int8 codes Wq^T for the backward, whose grad_input reads their
# transpose (BitNet.forward/backward; the backward used to quantize W again: 2 per use), and with
# gradient accumulation the step quantizes every BitNet weight before the microbatch scan and each
# microbatch reads those codes (Unsharded.step_weights; it used to quantize in every microbatch).
# The jaxpr holds the layer scan's body (or the stacked weights' quantizing map) once.
TERNARY_QUANTIZATIONS_PER_STEP = 1


def _rounds_by_shape(jaxpr) -> collections.Counter:
  """``round`` equations of ``jaxpr`` and every jaxpr nested in it (scan, pjit, remat...), by operand shape."""
  return collections.Counter(tuple(e.invars[0].aval.shape) for e in equations(jaxpr) if e.primitive.name == "round")


@pytest.mark.parametrize("placement", ["sub", "every_projection"])
@pytest.mark.parametrize("accum", [1, 2])
def test_ternary_weight_quantizations_per_step(placement, accum):
  # Widths chosen so that no weight [K, N] has the shape of an activation [tokens, K] that is rounded too;
  # 3 layers so that the accumulation scan (length accum) is told from the stacked weights' map (length 3).
  config = micro_config("unused", recipe="bitnet", grad_accum_steps=accum, model__n_layers=3, model__d_model=40,
                        model__d_ff=72, model__bitnet_norm_placement=placement)
  model_config = train_config.model_config(config)
  assert model_config.scan_layers
  spec = build(config, UNSHARDED)
  model, optimizer = Transformer(model_config), make_optimizer(spec)
  state = jax.eval_shape(steps.make_init(Unsharded(model), optimizer, spec))
  batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32)
  jaxpr = jax.make_jaxpr(steps.make_train_step(Unsharded(model), optimizer, spec))(state, batch).jaxpr
  rounds = _rounds_by_shape(jaxpr)
  kernels = {path: shape for path, shape in projection_paths(model_config).items() if model_config.recipe_for(path)}
  assert kernels and len(set(kernels.values())) == len(kernels)
  tokens = config.batch_size // accum * config.seq_len
  assert not set(kernels.values()) & {shape for shape in rounds if shape[0] == tokens}
  for path, shape in kernels.items():
    assert rounds[shape] == TERNARY_QUANTIZATIONS_PER_STEP, (path, shape, rounds)
  if accum > 1:  # and none of them inside the microbatch loop
    (microbatch_scan,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "scan" and eqn.params["length"] == accum]
    in_loop = _rounds_by_shape(microbatch_scan.params["jaxpr"].jaxpr)
    assert not any(in_loop[shape] for shape in kernels.values()), in_loop


@pytest.mark.parametrize("scan_layers,dtype", [(True, "float32"), (False, "bfloat16")])
def test_step_weights_give_the_per_microbatch_numbers(scan_layers, dtype):
  # A microbatch reading the step's quantized BitNet weights computes exactly the loss and gradients
  # of one that quantizes them itself (same codes and scales), whether the layers are scanned or not.
  config = micro_config("unused", recipe="bitnet", grad_accum_steps=2, model__n_layers=2,
                        model__scan_layers=scan_layers, model__dtype=dtype)
  spec = build(config, UNSHARDED)
  runtime = Unsharded(Transformer(spec.model))
  params = jax.jit(steps.make_init(runtime, make_optimizer(spec), spec))().params
  tokens = jax.random.randint(jax.random.key(1), (config.batch_size // 2, config.seq_len + 1), 0, 256)
  rng = jax.random.key(2)
  weights = jax.jit(runtime.step_weights)(params)
  assert weights and all(path[-1] in ("ternary_codes_t", "ternary_scale") for path in weights)
  own = jax.jit(runtime.loss_and_grads)(params, None, tokens, rng)
  shared = jax.jit(runtime.loss_and_grads)(params, None, tokens, rng, weights)
  assert jax.tree.structure(own) == jax.tree.structure(shared)
  for a, b in zip(jax.tree.leaves(own), jax.tree.leaves(shared)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("step_weights", [True, False])
def test_the_step_measures_the_gate_up_gradient_in_the_sub_norm(step_weights, monkeypatch):
  """The published BitNet model's gate_up projection takes its gradient's amaxes from ffn_sub_norm's backward
  (``ModelConfig.gate_up_measured``), in the trainer's microbatch with the step's ternary weights and without
  them; with ``policy.MEASURED_GRADIENTS`` off it measures them itself. Loss and gradients are the same, bit for
  bit."""
  config = micro_config("unused", recipe="bitnet", model__n_layers=2, model__bitnet_norm_placement="sub")
  spec = build(config, UNSHARDED)
  runtime = Unsharded(Transformer(spec.model))
  params = jax.jit(steps.make_init(runtime, make_optimizer(spec), spec))().params
  tokens = jax.random.randint(jax.random.key(1), (config.batch_size, config.seq_len + 1), 0, 256)
  weights = jax.jit(runtime.step_weights)(params) if step_weights else None
  given = record_measured_quantizations(monkeypatch)

  def run(measured):
    monkeypatch.setattr(policy, "MEASURED_GRADIENTS", measured)
    assert spec.model.gate_up_measured(None) is measured
    del given[:]
    out = jax.jit(runtime.loss_and_grads)(params, None, tokens, jax.random.key(2), weights)
    return out, sum(given)

  (got, n_measured), (want, n_plain) = run(True), run(False)
  assert n_measured >= 1 and n_plain == 0, (n_measured, n_plain)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# GPU: a few trainer steps per form on the 1B shape (configs/bitnet_1b.py), fused kernels on.

GPU_STEPS = 4
# Learning rate of the GPU runs: at 1e-3 with one warm-up step the 1B shape's training loss first
# rises (6.44 -> 6.95 -> 6.84 on an H100) while the validation loss already falls.
GPU_LR = 3e-4


@pytest.mark.gpu
@pytest.mark.parametrize("placement, activation, tied", FORMS, ids=str)
def test_1b_shape_trains_a_few_steps_per_form_on_gpu(placement, activation, tied, tmp_path):
  """Loss finite, the trained model better on held-out batches than the untrained one was on its
  first batch, a checkpoint written, for each form at d 2048 x 16 layers (short sequences so each
  form compiles and steps in about a minute). Step-to-step training losses are not compared: each
  step sees another batch."""
  config = train_config.load_file(CONFIGS / "bitnet_1b.py")
  config.model.update(bitnet_norm_placement=placement, mlp_activation=activation, tie_embeddings=tied)
  config.data.source = "synthetic"
  config.update(steps=GPU_STEPS, batch_size=4, seq_len=512, lr=GPU_LR, warmup_steps=1, log_every=1,
                eval_every=GPU_STEPS, eval_batches=2, checkpoint_every=GPU_STEPS, tensorboard=False)
  result = loop.train(config, tmp_path / placement)
  assert result.status == "completed" and result.step == GPU_STEPS
  losses = train_losses(tmp_path / placement)
  assert all(np.isfinite(list(losses.values()))), losses
  assert result.val_loss < losses[1], (result.val_loss, losses)
  assert generate.load_run(tmp_path / placement)[1] == train_config.model_config(config)
