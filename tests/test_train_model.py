"""train.model: parameter count, FLOPs, RoPE, causality, recipe wiring, BitNet norms, MLP activations,
scan/remat."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from helpers import fresh_key, rel_err
from jaxlowbit import BitNet, ExecutionOptions, Float8, Int8MixedPrecision
from jaxlowbit.parallel.tensor import COLUMN, ROW, TensorParallel
from jaxlowbit_numerics.stats import Split
from train import config as train_config
from train.model import (BITNET_NORM_PLACEMENTS, MLP_ACTIVATIONS, Mlp, ModelConfig, ProjectionLayout, Transformer,
                         param_count, projection_paths, rope, tensor_parallel_rules, train_flops_per_token)

SMALL = ModelConfig(vocab_size=384, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, dtype=jnp.float32)


def _real_count(config: ModelConfig) -> int:
  params = jax.eval_shape(Transformer(config).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  return sum(x.size for x in jax.tree.leaves(params))


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"recipe": BitNet()},
        {"recipe": BitNet(), "quantize_lm_head": True},
        {"recipe": BitNet(), "quantize_attention": False},
        {"recipe": Int8MixedPrecision(), "tie_embeddings": True},
        {"fused_projections": False, "recipe": BitNet()},
        {"scan_layers": False, "n_kv_heads": 4},
    ],
    ids=str,
)
def test_param_count_matches_the_tree(changes):
  config = dataclasses.replace(SMALL, **changes)
  assert param_count(config)["total"] == _real_count(config)


@pytest.mark.parametrize("placement, activation, fused, tied",
                         list(itertools.product(BITNET_NORM_PLACEMENTS, MLP_ACTIVATIONS, (True, False), (True, False))),
                         ids=str)
def test_param_count_matches_the_tree_for_every_bitnet_form(placement, activation, fused, tied):
  config = dataclasses.replace(SMALL, recipe=BitNet(), bitnet_norm_placement=placement, mlp_activation=activation,
                               fused_projections=fused, tie_embeddings=tied)
  assert param_count(config)["total"] == _real_count(config)
  if not tied:  # a BitNet LM head: every_projection gives it a norm, sub does not
    config = dataclasses.replace(config, quantize_lm_head=True)
    assert param_count(config)["total"] == _real_count(config)


def test_param_count_of_the_shipped_configs():
  for name in ("bf16_1b", "bitnet_1b", "bitnet_125m", "bitnet_8b", "tiny"):
    config = train_config.model_config(train_config.load_file(f"configs/{name}.py"))
    assert param_count(config)["total"] == _real_count(config), name


def test_flops_per_token_formula():
  config = dataclasses.replace(SMALL, tie_embeddings=True)
  d, hd, layers, seq = 64, 16, 2, 128
  linear = layers * (d * (4 * hd + 2 * 2 * hd) + 4 * hd * d + 3 * d * 96)
  matmul = linear + 384 * d  # the tied embedding is the LM head's matmul
  assert param_count(config)["matmul"] == matmul
  attention = 6 * layers * 4 * hd * seq  # QK^T and PV, causal half, fwd + bwd
  assert train_flops_per_token(config, seq) == 6 * matmul + attention


def test_rope_rotates_by_relative_position():
  key = fresh_key()
  q, k = jax.random.normal(key, (2, 1, 1, 1, 32))
  dots = []
  for m, n in ((5, 2), (13, 10), (40, 37)):
    qm = rope(q, jnp.array([m]), 10_000.0)
    kn = rope(k, jnp.array([n]), 10_000.0)
    dots.append(float(jnp.sum(qm * kn)))
    np.testing.assert_allclose(float(jnp.linalg.norm(qm)), float(jnp.linalg.norm(q)), rtol=1e-5)
  # Depends on m - n only, to float32 rounding at the dot's scale |q| |k| (the dot itself may nearly cancel: 5e-7
  # for seed 147087845, where a tolerance relative to it fails).
  scale = float(jnp.linalg.norm(q) * jnp.linalg.norm(k))
  np.testing.assert_allclose(dots, dots[0], rtol=0, atol=1e-5 * scale)
  ones = jnp.ones((1, 1, 1, 32))  # and it does rotate: sum_i 2 cos(3 theta_i) over the 16 pairs, not 32
  rotated = float(jnp.sum(rope(ones, jnp.array([5]), 10_000.0) * rope(ones, jnp.array([2]), 10_000.0)))
  assert abs(rotated - 32.0) > 1.0, rotated


def test_attention_is_causal():
  model = Transformer(SMALL)
  tokens = jax.random.randint(fresh_key(), (2, 24), 0, 259)
  params = jax.jit(model.init)(jax.random.key(0), tokens)
  changed = tokens.at[:, 16:].set((tokens[:, 16:] + 1) % 259)
  a, b = jax.jit(jax.vmap(model.apply, in_axes=(None, 0)))(params, jnp.stack([tokens, changed]))
  assert a.shape == (2, 24, 384) and a.dtype == jnp.float32
  np.testing.assert_array_equal(a[:, :16], b[:, :16])
  assert float(jnp.abs(a[:, 16:] - b[:, 16:]).max()) > 1e-3


def test_recipe_filters_choose_the_projections():
  config = dataclasses.replace(SMALL, recipe=Int8MixedPrecision(), quantize_attention=False, filter_fqns=("down",))
  recipes = {path: config.recipe_for(path) for path in projection_paths(config)}
  assert recipes == {
      "layers.attn.qkv": None,
      "layers.attn.out": None,
      "layers.mlp.gate_up": Int8MixedPrecision(),
      "layers.mlp.down": None,
      "lm_head": None,  # high precision by default
  }
  assert dataclasses.replace(config, quantize_lm_head=True).recipe_for("lm_head") == Int8MixedPrecision()
  with pytest.raises(ValueError, match="tied LM head"):
    dataclasses.replace(SMALL, recipe=BitNet(), tie_embeddings=True, quantize_lm_head=True)


@pytest.mark.parametrize("recipe", [Int8MixedPrecision(), Float8("tensorwise"), BitNet()], ids=str)
def test_recipe_runs_in_the_linears(recipe):
  """Same parameters: low-bit logits differ from float32 ones, but stay close."""
  tokens = jax.random.randint(fresh_key(), (2, 32), 0, 259)
  config = dataclasses.replace(SMALL, n_layers=1, bitnet_norms=False)
  reference, quantized = Transformer(config), Transformer(dataclasses.replace(config, recipe=recipe))

  @jax.jit
  def both(tokens):
    params = reference.init(jax.random.key(1), tokens)
    return reference.apply(params, tokens), quantized.apply(params, tokens)

  expected, actual = both(tokens)
  error = rel_err(actual, expected)
  assert 1e-6 < error < (0.3 if isinstance(recipe, BitNet) else 0.1), error


def test_bitnet_surgery_inserts_a_norm_before_each_bitnet_linear():
  config = dataclasses.replace(SMALL, recipe=BitNet(), quantize_attention=False)
  params = jax.eval_shape(Transformer(config).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  layer = params["layers"]
  assert set(layer["mlp"]) == {"gate_up", "gate_up_norm", "down", "down_norm"}
  assert set(layer["attn"]) == {"qkv", "out"}  # high-precision projections get no extra norm
  assert layer["mlp"]["down_norm"]["scale"].shape == (2, 96)
  plain = jax.eval_shape(Transformer(dataclasses.replace(SMALL, recipe=Int8MixedPrecision())).init,
                         jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  assert set(plain["layers"]["mlp"]) == {"gate_up", "down"}


def _param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  params = jax.eval_shape(Transformer(config).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  return {"/".join(path): leaf.shape for path, leaf in traverse_util.flatten_dict(params).items()}


@pytest.mark.parametrize("fused", [True, False], ids=["fused_projections", "separate_projections"])
def test_sub_placement_is_the_published_bitnet_parameter_set(fused):
  """Per layer: attn_norm, mlp_norm, the sub-norms attn/out_norm [d_model] and mlp/down_norm [d_ff], the
  projections; no other norm. Tied embeddings: no LM head (BitNet b1.58 2B4T, HF BitNetForCausalLM)."""
  config = dataclasses.replace(SMALL, recipe=BitNet(), bitnet_norm_placement="sub", tie_embeddings=True,
                               fused_projections=fused)
  layers, d, f, q, kv = SMALL.n_layers, SMALL.d_model, SMALL.d_ff, SMALL.n_heads * SMALL.head_dim, 2 * SMALL.head_dim
  if fused:
    projections = {"attn/qkv": (d, q + 2 * kv), "mlp/gate_up": (d, 2 * f)}
  else:
    projections = {"attn/q": (d, q), "attn/k": (d, kv), "attn/v": (d, kv), "mlp/gate": (d, f), "mlp/up": (d, f)}
  projections |= {"attn/out": (q, d), "mlp/down": (f, d)}
  expected = {"embed/embedding": (SMALL.vocab_size, d), "final_norm/scale": (d,),
              "layers/attn_norm/scale": (layers, d), "layers/mlp_norm/scale": (layers, d),
              "layers/attn/out_norm/scale": (layers, q), "layers/mlp/down_norm/scale": (layers, f)}
  expected |= {f"layers/{name}/kernel": (layers, *shape) for name, shape in projections.items()}
  assert _param_shapes(config) == expected
  # every_projection is the same tree plus a norm before q/k/v (or qkv) and gate/up (or gate_up)
  extra = set(_param_shapes(dataclasses.replace(config, bitnet_norm_placement="every_projection"))) - set(expected)
  inputs = ("attn/qkv", "mlp/gate_up") if fused else ("attn/q", "attn/k", "attn/v", "mlp/gate", "mlp/up")
  assert extra == {f"layers/{name}_norm/scale" for name in inputs}


def test_sub_norms_split_over_features_under_tensor_parallelism():
  config = dataclasses.replace(SMALL, recipe=BitNet(), bitnet_norm_placement="sub", fused_projections=False)
  rules = tensor_parallel_rules(config)
  assert {path for path in rules if path.endswith("_norm")} == {"attn.out_norm", "mlp.down_norm"}


def test_sub_placement_keeps_high_precision_projections_plain():
  config = dataclasses.replace(SMALL, recipe=BitNet(), bitnet_norm_placement="sub", quantize_attention=False)
  layer = jax.eval_shape(Transformer(config).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]["layers"]
  assert set(layer["attn"]) == {"qkv", "out"} and set(layer["mlp"]) == {"gate_up", "down", "down_norm"}


def _plain_mlp(x, kernels, activation):
  """float32 jnp reference of the gated MLP: down(act(gate(x)) * up(x))."""
  act = {"silu": jax.nn.silu, "relu2": lambda g: jnp.maximum(g, 0) ** 2}[activation]
  return (act(x @ kernels["gate"]) * (x @ kernels["up"])) @ kernels["down"]


@pytest.mark.parametrize("activation", MLP_ACTIVATIONS)
@pytest.mark.parametrize("fused", [True, False], ids=["fused_projections", "separate_projections"])
def test_mlp_activation_equals_a_plain_jnp_reference(activation, fused):
  """Forward and gradients (the fused op's own backward) of the model's MLP against jnp autodiff, float32."""
  config = dataclasses.replace(SMALL, mlp_activation=activation, fused_projections=fused)
  mlp = Mlp(config)
  x = jax.random.normal(fresh_key(), (3, 10, SMALL.d_model))
  params = mlp.init(jax.random.key(0), x)
  # large kernels so that relu2's negative half and its square both matter
  params = jax.tree.map(lambda w: w * 20, params)
  p = params["params"]

  def kernels(p):
    if fused:
      gate, up = jnp.split(p["gate_up"]["kernel"], 2, axis=-1)
    else:
      gate, up = p["gate"]["kernel"], p["up"]["kernel"]
    return {"gate": gate, "up": up, "down": p["down"]["kernel"]}

  got = mlp.apply(params, x).reshape(3, 10, -1)
  want = _plain_mlp(x, kernels(p), activation)
  assert rel_err(got, want) < 1e-5
  probe = jax.random.normal(fresh_key(), want.shape)
  g_got = jax.grad(lambda p, x: jnp.sum(mlp.apply({"params": p}, x).reshape(probe.shape) * probe), (0, 1))(p, x)
  g_want = jax.grad(lambda p, x: jnp.sum(_plain_mlp(x, kernels(p), activation) * probe), (0, 1))(p, x)
  for a, b in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want)):
    assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("activation", MLP_ACTIVATIONS)
def test_sub_model_fused_quantizers_equal_the_unfused_path(activation):
  """The `sub` model: its pre-norms quantize for q/k/v and gate/up, its sub-norms for out and down, in the
  same pass. With the straight-through high-precision backward, forward bit-equal and gradients equal up
  to float rounding to fused_quantizers=False, in float32 (in bf16 XLA's excess precision rounds the two
  graphs' residual adds differently). The trainer's int8 grad_input also quantizes g per row, where a
  rounding difference moves a code by one step now and then: both paths' gradients are then as close to
  the high-precision backward's (test_fused's bar)."""
  config = dataclasses.replace(SMALL, recipe=BitNet(), bitnet_norm_placement="sub", mlp_activation=activation)
  tokens = jax.random.randint(fresh_key(), (4, 17), 0, SMALL.vocab_size)
  params = Transformer(config).init(jax.random.key(0), tokens[:, :-1])

  def loss_and_grads(**changes):
    model = Transformer(dataclasses.replace(config, **changes))
    loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
        model.apply(p, tokens[:, :-1]), tokens[:, 1:]).mean()
    return jax.jit(jax.value_and_grad(loss))(params), jax.jit(model.apply)(params, tokens[:, :-1])

  (fused_loss, fused_grads), fused_logits = loss_and_grads()
  (plain_loss, plain_grads), plain_logits = loss_and_grads(fused_quantizers=False)
  np.testing.assert_array_equal(fused_logits, plain_logits)
  assert float(fused_loss) == float(plain_loss)
  for a, b in zip(jax.tree.leaves(fused_grads), jax.tree.leaves(plain_grads)):
    assert rel_err(a, b) < 1e-5
  (_, fused_int8), _ = loss_and_grads(recipe=BitNet(grad_input=True))
  (_, plain_int8), _ = loss_and_grads(recipe=BitNet(grad_input=True), fused_quantizers=False)
  for a, b, exact in zip(jax.tree.leaves(fused_int8), jax.tree.leaves(plain_int8), jax.tree.leaves(fused_grads)):
    assert rel_err(a, exact) <= 1.25 * rel_err(b, exact) + 1e-3


def test_projection_concerns_decide_alone():
  """Norm placement, quantizer choice and parallel layout of a projection, each from its own function."""
  sub = dataclasses.replace(SMALL, recipe=BitNet(), bitnet_norm_placement="sub", fused_projections=False)
  assert [sub.norm_before(p) for p in ("layers.attn.q", "layers.attn.out", "layers.mlp.up", "layers.mlp.down")] == [
      False, True, False, True]
  assert sub.own_norm_recipe("layers.mlp.down") == BitNet()
  assert dataclasses.replace(sub, fused_quantizers=False).own_norm_recipe("layers.mlp.down") is None
  assert sub.fused_input_recipe("layers.attn.q", "layers.attn.k", "layers.attn.v") == BitNet()  # the pre-norm's
  assert sub.fused_input_recipe("layers.mlp.down") is None  # its sub-norm quantizes instead of the activation
  assert sub.gather_recipe("layers.attn.q", "layers.attn.k") == BitNet()
  mixed = dataclasses.replace(sub, filter_fqns=("attn.k",))
  assert mixed.gather_recipe("layers.attn.q", "layers.attn.k") is None  # no common recipe: dtype travels

  tp = TensorParallel("tensor", 2)
  assert ProjectionLayout(tp, ROW).input_split == Split(cols=("tensor",))
  assert ProjectionLayout(tp, COLUMN).input_split == Split(rows=("tensor",))
  assert ProjectionLayout(tp, COLUMN, gathered=True).input_split is None
  assert ProjectionLayout(None, None).input_split is None
  x = jnp.ones((4, 8))
  assert ProjectionLayout(None, None).gather(x, BitNet()) is x
  assert ProjectionLayout.of("layers.attn.q", None) == ProjectionLayout(None, None)  # outside tensor parallelism
  # The layout comes from the execution options handed in (jaxlowbit.parallel.apply sets them), nothing global.
  assert ProjectionLayout.of("layers.attn.q", ExecutionOptions(tensor_parallel=tp)) == ProjectionLayout(tp, COLUMN)
  assert ProjectionLayout.of("layers.attn.out", ExecutionOptions(tensor_parallel=tp)) == ProjectionLayout(tp, ROW)


def test_scan_and_loop_compute_the_same_function():
  tokens = jax.random.randint(fresh_key(), (2, 16), 0, 259)
  scanned = Transformer(SMALL)
  looped = Transformer(dataclasses.replace(SMALL, scan_layers=False))

  @jax.jit
  def both(tokens):
    params = scanned.init(jax.random.key(2), tokens)["params"]
    unstacked = {k: v for k, v in params.items() if k != "layers"}
    for i in range(SMALL.n_layers):
      unstacked[f"layers_{i}"] = jax.tree.map(lambda x, i=i: x[i], params["layers"])
    return looped.apply({"params": unstacked}, tokens), scanned.apply({"params": params}, tokens)

  np.testing.assert_allclose(*both(tokens), rtol=1e-5, atol=1e-5)


def test_remat_policies_keep_the_gradient():
  tokens = jax.random.randint(fresh_key(), (2, 16), 0, 259)
  params = jax.jit(Transformer(SMALL).init)(jax.random.key(3), tokens)

  @jax.jit
  def grads(params):
    def grad(policy):
      model = Transformer(dataclasses.replace(SMALL, remat_policy=policy))
      return jax.grad(lambda p: model.apply(p, tokens).mean())(params)

    return grad("none"), grad("full")

  reference, *others = grads(params)
  for other in others:
    for a, b in zip(jax.tree.leaves(other), jax.tree.leaves(reference)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)


def test_bad_model_configs_are_rejected():
  with pytest.raises(ValueError, match="multiple of n_kv_heads"):
    dataclasses.replace(SMALL, n_kv_heads=3)
  with pytest.raises(ValueError, match="remat_policy"):
    dataclasses.replace(SMALL, remat_policy="some")
  with pytest.raises(TypeError, match="sequence of strings"):
    dataclasses.replace(SMALL, filter_fqns="lm_head")
  with pytest.raises(ValueError, match="empty string"):  # "" is in every path: it would keep every layer
    dataclasses.replace(SMALL, filter_fqns=("",))
  with pytest.raises(ValueError, match=r"bitnet_norm_placement='subnorm'; choose one of \('sub', 'every_projection'\)"):
    dataclasses.replace(SMALL, bitnet_norm_placement="subnorm")
  with pytest.raises(ValueError, match=r"mlp_activation='gelu'; choose one of \('silu', 'relu2'\)"):
    dataclasses.replace(SMALL, mlp_activation="gelu")
