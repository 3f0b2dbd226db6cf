"""train.model: parameter count, FLOPs, RoPE, causality, recipe wiring, BitNet surgery, scan/remat."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import fresh_key, rel_err
from jaxlowbit import BitNet, Float8, Int8MixedPrecision
from train import config as train_config
from train.model import ModelConfig, Transformer, param_count, projection_paths, rope, train_flops_per_token

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


def test_param_count_of_the_shipped_configs():
  for name in ("bf16_1b", "bitnet_1b", "bitnet_125m", "tiny"):
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
  np.testing.assert_allclose(dots, dots[0], rtol=1e-4)  # depends on m - n only
  assert abs(dots[0] - float(jnp.sum(q * k))) > 1e-3  # and it does rotate


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
