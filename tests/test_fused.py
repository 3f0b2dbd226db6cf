"""jaxlowbit.fused: RMSNorm / gated-activation (SwiGLU, squared ReLU) producers hand quantized_matmul a
pre-quantized input.

- the operand they produce is exactly the unfused op's output quantized for the recipe;
- through quantized_matmul, forward equal to the unfused path and gradients as accurate
  (against float64) as autodiff of the unfused path;
- the gated activations (silu, relu2) and their one-pass backward against plain jnp / float64 autodiff;
- the model with fused quantizers trains like the model without (same loss, gradients as close
  to a float32 model's).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

import jaxlowbit
from jaxlowbit import BitNet, Float8, Int8MixedPrecision, fused
from jaxlowbit.recipes.base import quantize_operand
from pallas_kernels import dispatch, quantize
from pallas_kernels.quantize import GATE_ACTIVATIONS
from helpers import equations, fresh_key, rel_err
from train.model import ModelConfig, Transformer

RECIPES = [Int8MixedPrecision(), Float8("tensorwise"), Float8("rowwise"), BitNet(), BitNet(True, True)]
BF16_ROUNDING = 2.0**-8  # relative spacing of bfloat16: one rounding of a gradient


def _same_operand(got, rows, transposed):
  np.testing.assert_array_equal(np.asarray(got.rows.data, np.float32), np.asarray(rows.data, np.float32))
  np.testing.assert_array_equal(got.rows.scale, rows.scale)
  np.testing.assert_array_equal(np.asarray(got.transposed.data, np.float32), np.asarray(transposed.data, np.float32))
  np.testing.assert_array_equal(got.transposed.scale, transposed.scale)


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_producers_quantize_exactly_the_unfused_output(recipe):
  kx, ks, kg = jax.random.split(fresh_key(), 3)
  x = (jax.random.normal(kx, (2, 48, 64)) * 3).astype(jnp.bfloat16)
  scale = 1 + 0.1 * jax.random.normal(ks, (64,))
  how = recipe.input_quantization()
  _same_operand(fused.rms_norm_for(x, scale, 1e-5, recipe, jnp.bfloat16),
                *quantize_operand(fused.rms_norm(x, scale, 1e-5, jnp.bfloat16).reshape(96, 64), how))
  gate_up = jax.random.normal(kg, (96, 128)).astype(jnp.bfloat16)
  for activation in GATE_ACTIVATIONS:
    _same_operand(fused.swiglu_for(gate_up, recipe, activation=activation),
                  *quantize_operand(fused.swiglu(gate_up, activation), how))


def test_recipes_that_need_high_precision_inputs_get_them():
  x = jnp.ones((4, 32), jnp.bfloat16)
  for recipe in (None, Float8("rowwise_gw_hp"), Int8MixedPrecision(grad_weight=False)):
    assert fused.fused_quantization(recipe) is None
    out = fused.rms_norm_for(x, jnp.ones(32), 1e-5, recipe, jnp.bfloat16)
    np.testing.assert_array_equal(out, fused.rms_norm(x, jnp.ones(32), 1e-5, jnp.bfloat16))


def _exact_grads(fn, *args):
  """float64 gradients of ``fn`` (a function of float arrays) at ``args``."""
  with jax.enable_x64(True):
    return jax.grad(fn, argnums=tuple(range(len(args))))(*(jnp.asarray(a, jnp.float64) for a in args))


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_gradients_through_the_producers_match_the_unfused_path(recipe):
  kx, ks, kw, kg = jax.random.split(fresh_key(), 4)
  x = jax.random.normal(kx, (64, 128)).astype(jnp.bfloat16)
  scale = 1 + 0.1 * jax.random.normal(ks, (128,))
  w = jax.random.normal(kw, (128, 96)) / 12
  gate_up = jax.random.normal(kg, (64, 256)).astype(jnp.bfloat16)
  w_down = jax.random.normal(kw, (128, 96)) / 12

  def norm_then(fuse):
    op = fused.rms_norm_for if fuse else lambda x, s, e, r, d: fused.rms_norm(x, s, e, d)
    return lambda x, s, w: jnp.sum(jaxlowbit.quantized_matmul(op(x, s, 1e-5, recipe, jnp.bfloat16), w, recipe)
                                   .astype(jnp.float32) ** 2)

  def swiglu_then(fuse, activation="silu"):
    op = (lambda g, r: fused.swiglu_for(g, r, activation=activation)) if fuse else lambda g, r: fused.swiglu(
        g, activation)
    return lambda g, w: jnp.sum(jaxlowbit.quantized_matmul(op(g, recipe), w, recipe).astype(jnp.float32) ** 2)

  def relu2_then(fuse):
    return swiglu_then(fuse, "relu2")

  for make, args in ((norm_then, (x, scale, w)), (swiglu_then, (gate_up, w_down)), (relu2_then, (gate_up, w_down))):
    got, want = jax.grad(make(True), argnums=(0, 1))(*args), jax.grad(make(False), argnums=(0, 1))(*args)
    np.testing.assert_array_equal(make(True)(*args), make(False)(*args))  # the same forward
    for a, b in zip(got, want):  # the same math, rounded in another order: a bf16 rounding apart at most
      assert rel_err(a, b) <= 2 * BF16_ROUNDING, (make.__name__, rel_err(a, b))


@pytest.mark.parametrize("activation", GATE_ACTIVATIONS)
@pytest.mark.parametrize("recipe", [BitNet(True, True), BitNet(), Int8MixedPrecision(), None], ids=str)
def test_norm_of_the_gated_activation_is_the_two_producers_in_one(recipe, activation):
  """swiglu_rms_norm_for (BitNet's ffn_sub_norm after the gated activation): exactly the operand (or, without a
  quantizing recipe, the array) of swiglu then rms_norm_for; through quantized_matmul, the unfused path's forward
  and, from its one-pass backward, gradients a bf16 rounding apart at most."""
  kg, ks, kw = jax.random.split(fresh_key(), 3)
  gate_up = (2 * jax.random.normal(kg, (2, 32, 256))).astype(jnp.bfloat16)
  scale = 1 + 0.1 * jax.random.normal(ks, (128,))
  w = jax.random.normal(kw, (128, 96)) / 12

  def producer(fuse):
    if fuse:
      return lambda g, s: fused.swiglu_rms_norm_for(g, s, 1e-5, recipe, jnp.bfloat16, activation=activation)
    return lambda g, s: fused.rms_norm_for(fused.swiglu(g, activation), s, 1e-5, recipe, jnp.bfloat16)

  got, want = producer(True)(gate_up, scale), producer(False)(gate_up, scale)
  if recipe is None:
    assert got.shape == (2, 32, 128) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got, want)
    return
  _same_operand(got, want.rows, want.transposed)

  def loss(fuse):
    return lambda g, s, w: jnp.sum(jaxlowbit.quantized_matmul(producer(fuse)(g, s), w, recipe)
                                   .astype(jnp.float32) ** 2)

  np.testing.assert_array_equal(loss(True)(gate_up, scale, w), loss(False)(gate_up, scale, w))
  grads = [jax.grad(loss(f), argnums=(0, 1, 2))(gate_up, scale, w) for f in (True, False)]
  for a, b in zip(*grads):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert rel_err(a, b) <= 2 * BF16_ROUNDING, rel_err(a, b)


def test_sub_norm_backward_reads_its_bf16_residual():
  """The ffn_sub_norm backward reads h as the bf16 residual the forward saved, behind an optimization barrier: XLA
  folded the cast of h back to float32 into the forward's float32 value, and on the GPU the forward fusion then
  wrote h a second time in float32 for the backward (twice h's bytes, 1B step). The gradient's jaxpr holds one
  barrier, on h's bf16 [M, H] residual, and the backward casts its output to float32."""
  gate_up = jax.random.normal(fresh_key(), (64, 2 * 96)).astype(jnp.bfloat16)
  scale, w = jnp.ones((96,)), jnp.ones((96, 32)) / 10
  recipe = BitNet.presets["bitnet"]

  def loss(g, s, w):
    operand = fused.swiglu_rms_norm_for(g, s, 1e-5, recipe, jnp.bfloat16)
    return jnp.sum(jaxlowbit.quantized_matmul(operand, w, recipe).astype(jnp.float32))

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(gate_up, scale, w)
  eqns = list(equations(jaxpr.jaxpr))
  barriers = [e for e in eqns if e.primitive.name == "optimization_barrier"]
  assert [(v.aval.shape, v.aval.dtype) for e in barriers for v in e.invars] == [((64, 96), jnp.bfloat16)], barriers
  (h,) = barriers[0].outvars
  assert any(e.primitive.name == "convert_element_type" and e.params["new_dtype"] == jnp.float32
             for e in eqns if h in e.invars)


@pytest.mark.parametrize("consumer", ["sub_norm", "measured_values"])
def test_measured_gate_up_gets_its_gradients_amaxes_from_the_consumer(consumer, monkeypatch):
  """A linear with a measured output (``quantized_matmul(..., measured=True)``) gets its output gradient's row and
  column amaxes from the consumer's backward: BitNet's fused ffn_sub_norm (measured as its one pass writes
  d gate_up) or any consumer through ``measured_values`` (measured in XLA). Its backward hands exactly those amaxes
  to the quantizer of g, and the loss and every gradient equal the unmeasured linear's."""
  kx, kg, ks, kd = jax.random.split(fresh_key(), 4)
  x = jax.random.normal(kx, (64, 128)).astype(jnp.bfloat16)
  w_gate_up = jax.random.normal(kg, (128, 2 * 96)) / 11
  scale = 1 + 0.1 * jax.random.normal(ks, (96,))
  w_down = jax.random.normal(kd, (96, 32)) / 10
  recipe = BitNet.presets["bitnet"]
  seen = []
  plain_quantize = dispatch.quantize_rows_and_cols_t

  def recording(g, spec, options=None, maxima=None):
    if maxima is not None:
      jax.debug.callback(lambda *a: seen.append(a), *maxima, *quantize.amaxes(g))
    return plain_quantize(g, spec, options, maxima)

  monkeypatch.setattr(dispatch, "quantize_rows_and_cols_t", recording)

  def loss(measured):
    def f(x, w_gate_up, scale, w_down):
      y = jaxlowbit.quantized_matmul(x, w_gate_up, recipe, measured=measured)
      if consumer == "sub_norm":
        h = fused.swiglu_rms_norm_for(y, scale, 1e-5, recipe, jnp.bfloat16)
      else:
        h = fused.rms_norm_for(fused.swiglu(fused.measured_values(y)), scale, 1e-5, recipe, jnp.bfloat16)
      return jnp.sum(jaxlowbit.quantized_matmul(h, w_down, recipe).astype(jnp.float32) ** 2)
    return f

  args = (x, w_gate_up, scale, w_down)
  got = jax.value_and_grad(loss(True), argnums=(0, 1, 2, 3))(*args)
  assert len(seen) == 1, len(seen)  # the gate_up linear's g, with the consumer's amaxes
  rowmax, colmax, want_rowmax, want_colmax = seen[0]
  assert rowmax.shape == (64,) and colmax.shape == (2 * 96,)
  np.testing.assert_array_equal(rowmax, want_rowmax)
  np.testing.assert_array_equal(colmax, want_colmax)
  want = jax.value_and_grad(loss(False), argnums=(0, 1, 2, 3))(*args)
  assert len(seen) == 1  # the unmeasured linear measures g itself
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)


def test_measured_output_refuses_what_it_cannot_serve():
  x, w = jnp.ones((8, 32), jnp.bfloat16), jnp.ones((32, 16))
  with pytest.raises(ValueError, match="measured output needs a recipe"):
    jaxlowbit.quantized_matmul(x, w, None, measured=True)
  with pytest.raises(ValueError, match="non-empty 2-D x"):
    jaxlowbit.quantized_matmul(x.reshape(2, 4, 32), w, BitNet(), measured=True)
  layer = jaxlowbit.BitNetDense(features=16, use_bias=True, measured=True)
  with pytest.raises(ValueError, match="no bias"):
    layer.init(jax.random.key(0), x)
  out = jaxlowbit.BitNetDense(features=16, use_bias=False, measured=True).init_with_output(
      jax.random.key(0), x.reshape(2, 4, 32))[0]
  assert out.values.shape == (8, 16) and out.maxima.shape == (24,) and out.maxima.dtype == jnp.float32


PLAIN_GATES = {"silu": jax.nn.silu, "relu2": lambda g: jnp.maximum(g, 0) ** 2}


@pytest.mark.parametrize("activation", GATE_ACTIVATIONS)
def test_gated_activation_and_its_backward_equal_plain_jnp(activation):
  """``act(gate) * up`` against plain jnp (float32, exactly: the same float32 expression rounded once) and
  its one-pass backward against float64 autodiff (one bf16 rounding)."""
  kg, kd = jax.random.split(fresh_key())
  gate_up = (2 * jax.random.normal(kg, (2, 40, 256))).astype(jnp.bfloat16)  # relu2's negative half included
  dh = jax.random.normal(kd, (2, 40, 128)).astype(jnp.bfloat16)
  plain = lambda gu: PLAIN_GATES[activation](gu[..., :128]) * gu[..., 128:]  # noqa: E731
  got = fused.swiglu_for(gate_up, None, activation=activation)
  assert got.dtype == jnp.bfloat16 and got.shape == (2, 40, 128)
  want = plain(gate_up.astype(jnp.float32)).astype(jnp.bfloat16)
  assert rel_err(got, want) <= BF16_ROUNDING  # silu: exp's last bit may round another way
  _, vjp = jax.vjp(lambda gu: fused.swiglu(gu, activation), gate_up)
  (d_gate_up,) = vjp(dh)
  (exact,) = _exact_grads(lambda gu: jnp.sum(plain(gu) * dh.astype(jnp.float64)), gate_up)
  assert d_gate_up.dtype == jnp.bfloat16 and rel_err(d_gate_up, exact) <= BF16_ROUNDING
  with pytest.raises(ValueError, match="choose one of"):
    fused.swiglu_for(gate_up, None, activation="gelu")


def test_norm_backward_is_as_accurate_as_autodiff():
  kx, ks, kg = jax.random.split(fresh_key(), 3)
  x = jax.random.normal(kx, (64, 128)).astype(jnp.bfloat16)
  scale = 1 + 0.1 * jax.random.normal(ks, (128,))
  dy = jax.random.normal(kg, (64, 128)).astype(jnp.bfloat16)
  _, vjp = jax.vjp(lambda x, s: fused.rms_norm_for(x, s, 1e-5, Int8MixedPrecision(), jnp.bfloat16).carrier, x, scale)
  dx, dscale = vjp(dy)
  exact = lambda x, s: jnp.sum(x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * s * dy)  # noqa: E731
  ex_dx, ex_dscale = _exact_grads(exact, x, scale)
  assert rel_err(dx, ex_dx) <= BF16_ROUNDING  # dx is bf16: one rounding
  assert rel_err(dscale, ex_dscale) <= 1e-5


# (BitNet adds norms, so a float32 model of the same tree would not be BitNet's reference.)
@pytest.mark.parametrize("recipe", [Int8MixedPrecision(), Float8("tensorwise"), Float8("rowwise")], ids=str)
def test_model_with_fused_quantizers_trains_like_without(recipe):
  tokens = jax.random.randint(fresh_key(), (4, 33), 0, 384)
  reference = Transformer(ModelConfig(recipe=None, dtype=jnp.float32))
  params = reference.init(jax.random.key(0), tokens[:, :-1])

  def grads(model):
    loss = lambda p: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
        model.apply(p, tokens[:, :-1]), tokens[:, 1:]).mean()
    value, g = jax.jit(jax.value_and_grad(loss))(params)
    return float(value), traverse_util.flatten_dict(g["params"])

  _, exact = grads(reference)
  (fused_loss, fused_g), (plain_loss, plain_g) = (grads(Transformer(ModelConfig(recipe=recipe, fused_quantizers=f)))
                                                  for f in (True, False))
  assert abs(fused_loss - plain_loss) <= 1e-3 * plain_loss
  for path, g in exact.items():  # quantization noise of the same size: fusion changes rounding order only
    e_fused, e_plain = rel_err(fused_g[path], g), rel_err(plain_g[path], g)
    assert e_fused <= 1.25 * e_plain + 1e-3, (path, e_fused, e_plain)
