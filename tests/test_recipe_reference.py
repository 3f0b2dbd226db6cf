"""Every recipe's three matmuls against an independent float64 fake-quant reference.

The reference is written here from the README's recipe table and DESIGN.md's formulas, with numpy
and ml_dtypes only (no scale helper of the library): each operand quantized along the axes the
table gives, float32 scales as the contract computes them, e4m3 / e5m2 casts by ml_dtypes (round to
nearest even, saturating), then the dequantized operands multiplied in float64. The library must
agree to 1e-5 of ``sum |a_i b_i|`` per output element (float32 accumulation and scale rounding).

Rounding ties: where an operand's float32 value lies within a few ulps of the midpoint of two codes,
the library's float32 arithmetic may round it the other way, so the bound adds, per output element,
the most such elements can move it (their code step times the other operand). Elsewhere the codes
must be the reference's, so one wrong axis, format or scale anywhere fails by orders of magnitude.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from helpers import fresh_key
from jaxlowbit import BitNet, Float8, Int8MixedPrecision, quantized_matmul

M, K, N = 96, 256, 128
SEEDS = 3
# Agreement per output element, relative to sum |a_i b_i| of its dequantized operands.
REL = 1e-5
# A float32 value this many ulps from a rounding midpoint counts as a tie (the library may compute
# it by another float32 route, e.g. x * (1/s) against x / s: a few ulps apart).
TIE_ULPS = 8
# Hopper's FP8 wgmma does not accumulate in full float32: with the codes equal to the reference's
# (checked on an H100: 0 of 131072 differ, every format and axis), the forced-Pallas FP8 GEMMs still
# differ from the float64 sum by up to 1.4e-3 (output, grad_input, K 512) and 3.1e-3 (grad_weight, K
# 256) of sum |a b|, unbiased (12 draws, H100, jax 0.11.2; int8 stays within 3e-7). The GPU bound is
# 2.5x the worst of those; e5m2 activations in place of e4m3 are off by 0.04-0.06, 5x beyond it.
HOPPER_FP8_REL = 2.0**-7
E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}  # the formats' largest finite values (DESIGN.md)


class Fake:
  """A fake-quantized operand: float64 ``value`` (dequantized) and ``slack``, the most a tie
  may move each element (0 where the code is certain)."""

  def __init__(self, value, slack=None):
    self.value = np.asarray(value, np.float64)
    self.slack = np.zeros_like(self.value) if slack is None else slack


def _near(y32, mid):
  """Whether float32 values ``y32`` lie within TIE_ULPS ulps of the rounding midpoints ``mid``."""
  return np.abs(y32.astype(np.float64) - mid) <= TIE_ULPS * np.spacing(np.abs(y32)).astype(np.float64)


def int8(a, axis, eps=1e-12):
  """Symmetric int8 over ``axis`` (None: per tensor): scale = max(amax, eps) / 127, codes round half
  to even and clip to +-127 (DESIGN.md)."""
  a = np.asarray(a, np.float32)
  amax = np.max(np.abs(a), axis=axis, keepdims=True)
  scale = np.float32(np.maximum(amax.astype(np.float64), eps) / 127)
  y = a / scale
  q = np.clip(np.rint(y), -127, 127)
  tie = _near(y, np.floor(y) + 0.5) & (np.abs(y) < 127)
  return Fake(q * scale.astype(np.float64), tie * scale.astype(np.float64))


def fp8(a, dtype, axis, power_of_two=False):
  """FP8 over ``axis`` (None: per tensor): multiplier fmax / max(amax, 1e-12) in float32 (rounded down
  to a power of two for rowwise), saturating cast of a * multiplier, dequantized by dividing."""
  a = np.asarray(a, np.float32)
  fmax = np.float32(FP8_MAX[dtype])
  amax = np.max(np.abs(a), axis=axis, keepdims=True)
  mult = fmax / np.maximum(amax, np.float32(1e-12))
  if power_of_two:
    mult = np.exp2(np.floor(np.log2(mult))).astype(np.float32)
  y = np.clip(a * mult, -fmax, fmax).astype(np.float32)
  q = y.astype(dtype).astype(np.float64)
  # The two codes around y and their midpoint: the next code away from q on y's side.
  step_up = np.nextafter(q.astype(dtype), np.where(y >= q, dtype(np.inf), dtype(-np.inf))).astype(np.float64)
  other = np.where(np.isfinite(step_up) & (np.abs(step_up) <= fmax), step_up, q)
  tie = _near(y, (q + other) / 2) & (other != q)
  return Fake(q / mult, tie * np.abs(other - q) / mult)


def ternary(w):
  """BitNet weights: s = max(mean |W|, 1e-5) in float32, codes clip(round(W / s), -1, 1)."""
  w = np.asarray(w, np.float32)
  s = np.float32(max(np.mean(np.abs(w.astype(np.float64))), 1e-5))
  y = w / s
  q = np.clip(np.rint(y), -1, 1)
  tie = _near(y, np.sign(y) * 0.5)
  return Fake(q * np.float64(s), tie * np.float64(s))


def hp(a):
  return Fake(np.asarray(a, np.float32))


def matmul(a: Fake, b: Fake, rel: float = REL):
  """``(a @ b, tolerance)`` in float64: ``rel`` of sum |a_i b_i| plus what the ties can move."""
  abs_a, abs_b = np.abs(a.value), np.abs(b.value)
  slack = a.slack @ (abs_b + b.slack) + abs_a @ b.slack
  return a.value @ b.value, rel * (abs_a @ abs_b) + slack + 1e-30


# The README's recipe table, operand by operand: forward y = x W, grad_input dx = g W^T, grad_weight
# dW = x^T g, for x [M, K], W [K, N], g [M, N]. Axis 1 reduces over a row (per token of x or g, per
# input channel of W); axis 0 over a column (per output channel of W, per feature of x or g).
def int8_mixed_precision(x, w, g):
  return ((int8(x, 1), int8(w, 0)),
          (int8(g, 1), Fake(int8(w, 1).value.T, int8(w, 1).slack.T)),
          (_t(int8(x, 0)), int8(g, 0)))


def float8_tensorwise(x, w, g):
  return ((fp8(x, E4M3, None), fp8(w, E4M3, None)),
          (fp8(g, E5M2, None), _t(fp8(w, E4M3, None))),
          (_t(fp8(x, E4M3, None)), fp8(g, E5M2, None)))


def float8_rowwise(x, w, g, grad_weight_hp=False):
  rows = functools.partial(fp8, dtype=E4M3, power_of_two=True)
  gw = (_t(hp(x)), hp(g)) if grad_weight_hp else (_t(rows(x, axis=0)), rows(g, axis=0))
  return ((rows(x, axis=1), rows(w, axis=0)), (rows(g, axis=1), _t(rows(w, axis=1))), gw)


def bitnet(x, w, g, grad_input=False, grad_weight=False):
  """Forward ternary W x int8 x (eps 1e-5); straight-through backward against the quantized operands:
  high precision, or int8 g per token (grad_input) / int8 x and g per feature over the tokens (grad_weight)."""
  xq, wq = int8(x, 1, eps=1e-5), ternary(w)
  gi = (int8(g, 1) if grad_input else hp(g), _t(wq))
  gw = (_t(int8(x, 0, eps=1e-5)), int8(g, 0)) if grad_weight else (_t(xq), hp(g))
  return (xq, wq), gi, gw


def _t(f: Fake) -> Fake:
  return Fake(f.value.T, f.slack.T)


RECIPES = {
    Int8MixedPrecision(): int8_mixed_precision,
    Float8("tensorwise"): float8_tensorwise,
    Float8("rowwise"): float8_rowwise,
    Float8("rowwise_gw_hp"): functools.partial(float8_rowwise, grad_weight_hp=True),
    BitNet(): bitnet,
    BitNet(grad_input=True): functools.partial(bitnet, grad_input=True),
    BitNet(grad_input=True, grad_weight=True): functools.partial(bitnet, grad_input=True, grad_weight=True),
}


def outlier_inputs(key, m=M, k=K, n=N):
  """float32 x [M, K], W [K, N], g [M, N]: normal, with outlier rows (x100) and outlier features
  (x30) in x, outlier rows in g, and one outlier output channel in W."""
  M, K, N = m, k, n  # noqa: N806
  kx, kw, kg, kr, kc = jax.random.split(key, 5)
  x = np.array(jax.random.normal(kx, (M, K)), np.float32)
  w = np.array(jax.random.normal(kw, (K, N)), np.float32) / np.float32(np.sqrt(K))
  g = np.array(jax.random.normal(kg, (M, N)), np.float32)
  rows = np.asarray(jax.random.choice(kr, M, (4,), replace=False))
  cols = np.asarray(jax.random.choice(kc, K, (3,), replace=False))
  x[rows] *= 100
  x[:, cols] *= 30
  g[rows[:2]] *= 50
  w[:, 7] *= 20
  return x, w, g


@functools.partial(jax.jit, static_argnums=0)
def _fwd_bwd(recipe, x, w, g):
  y, vjp = jax.vjp(lambda x, w: quantized_matmul(x, w, recipe), x, w)
  return (y, *vjp(g))


def assert_matches_the_reference(recipe, shape=(M, K, N), rel=REL):
  key = fresh_key()
  for seed in range(SEEDS):
    x, w, g = outlier_inputs(jax.random.fold_in(key, seed), *shape)
    outs = _fwd_bwd(recipe, jnp.asarray(x), jnp.asarray(w), jnp.asarray(g))
    for name, out, operands in zip(("output", "grad_input", "grad_weight"), outs, RECIPES[recipe](x, w, g)):
      want, tol = matmul(*operands, rel=rel)
      got = np.asarray(out, np.float64)
      assert got.shape == want.shape, (name, got.shape, want.shape)
      err = np.abs(got - want)
      worst = np.unravel_index(np.argmax(err / tol), err.shape)
      assert np.all(err <= tol), (
          f"{recipe} {name} (draw {seed}): off the fake-quant reference by {np.max(err / tol):.3g}x the "
          f"tolerance at {worst}: got {got[worst]:.6g}, want {want[worst]:.6g}")


@pytest.mark.parametrize("recipe", list(RECIPES), ids=str)
def test_every_matmul_matches_the_fake_quant_reference(recipe, float32_matmuls):
  """The default dispatch (XLA on CPU; on a GPU the kernels where they win)."""
  assert_matches_the_reference(recipe)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", list(RECIPES), ids=str)
def test_forced_pallas_kernels_match_the_fake_quant_reference(recipe, float32_matmuls, monkeypatch):
  """The Pallas quantizers and GEMM (JAXLOWBIT_BACKEND=pallas) against the same independent
  reference: a scale helper wrong in both kernel and library reference cannot cancel out here."""
  from pallas_kernels import policy

  monkeypatch.setenv(policy.BACKEND_ENV, "pallas")
  shape = (256, 512, 256)  # tiled by every quantize kernel
  m, k, n = shape
  text = _fwd_bwd.lower(recipe, *(jax.ShapeDtypeStruct(s, jnp.float32) for s in ((m, k), (k, n), (m, n)))).as_text()
  # a quantize kernel (rows, or the tiled statistics and transposed passes) and the Hopper GEMM
  assert "jaxlowbit_quantize_" in text and "mosaic_gpu" in text, "the kernels did not run"
  assert_matches_the_reference(recipe, shape, rel=HOPPER_FP8_REL if isinstance(recipe, Float8) else REL)


def test_the_reference_tells_the_formats_and_axes_apart():
  """The reference itself: e5m2 activations, or int8 per tensor, are far outside its tolerance."""
  x, w, g = outlier_inputs(fresh_key())
  want, tol = matmul(fp8(x, E4M3, None), fp8(w, E4M3, None))
  wrong, _ = matmul(fp8(x, E5M2, None), fp8(w, E4M3, None))
  assert np.max(np.abs(wrong - want) / tol) > 100
  _, gpu_tol = matmul(fp8(x, E4M3, None), fp8(w, E4M3, None), rel=HOPPER_FP8_REL)
  assert np.max(np.abs(wrong - want) / gpu_tol) > 2, "the GPU's FP8 bound would let e5m2 activations pass"
  want, tol = matmul(int8(x, 1), int8(w, 0))
  wrong, _ = matmul(int8(x, None), int8(w, 0))
  assert np.max(np.abs(wrong - want) / tol) > 100
