"""Shared by the fused-Adam kernel tests (CPU interpret mode and GPU): formats, fresh inputs, and
the comparison of kernel and XLA update that allows codes to differ only at ties."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxlowbit import optim, qstate
from jaxlowbit_numerics.adam import adam_coefficients, adam_moments, fit_moments
from pallas_kernels import adam as ak

# The (m, v) formats of adamw_8bit, adamw_4bit, adamw_fp8 and adamw_fp8_o2.
FORMATS = {name: optim.moment_formats(f"adamw_{name}") for name in ("8bit", "4bit", "fp8", "fp8_o2")}
# A code may differ from XLA's only where the exact moment lies this close to the midpoint of the
# two codes, relative to the magnitude of the terms it is summed from (b1 m and (1 - b1) g may
# cancel): the kernel and XLA may round a*b+c differently (FMA), an ulp of those terms.
TIE_RTOL = 1e-6
# Ties are rare: 0 differing codes on CPU in 48 draws (the same arithmetic); on a GPU, FMA
# contraction may differ between Triton and XLA (expected: a few per 1e6; not yet measured).
MAX_TIE_FRACTION = 1e-3
# u = m_hat / (sqrt(v_hat) + eps): a division and a square root, each within an ulp or two.
# Interpret mode on CPU, 32 draws: worst error 2.9e-7 of terms / denominator (about 2.5 ulps).
U_RTOL = 2e-6


def random_case(key, shape, m_format, v_format, grad_dtype=jnp.float32, hyper_arrays=False):
  """Fresh inputs of one step: ``(g, m, v, coefficients)``.

  Blocks span 8 decades of magnitude (rows scaled by ``logspace``), one row of each moment
  is all zeros (a fresh state: zero scales), the step count is random (bias corrections),
  ``eps_root`` is zero or not. ``hyper_arrays``: b1, b2, eps as float32 arrays
  (``optax.inject_hyperparams``).
  """
  keys = jax.random.split(key, 6)
  rows = int(np.prod(shape[:-1]))
  row_scale = jnp.logspace(-6, 2, rows).reshape(*shape[:-1], 1)
  m = jax.random.normal(keys[0], shape) * row_scale * 1e-3
  v = jnp.square(jax.random.normal(keys[1], shape) * row_scale * 1e-3) + 1e-20
  zero_row = (0,) * (len(shape) - 1)
  m, v = m.at[zero_row].set(0.0), v.at[zero_row].set(0.0)
  g = (jax.random.normal(keys[2], shape) * jax.random.permutation(keys[3], row_scale.ravel()).reshape(row_scale.shape)
       * 1e-3).astype(grad_dtype)
  count = jax.random.randint(keys[4], (), 1, 10_000)
  eps_root = float(jax.random.choice(keys[5], jnp.array([0.0, 1e-12])))
  b1, b2, eps = 0.9, 0.999, 1e-8
  if hyper_arrays:
    b1, b2, eps = (jnp.float32(x) for x in (b1, b2, eps))
  coefficients = adam_coefficients(b1, b2, eps, eps_root, count, count + 1)
  return g, qstate.quantize_blockwise(m, m_format), qstate.quantize_blockwise(v, v_format), coefficients


def _normalized(codes, fmt):
  """Unpacked codes as values in the block's code range (float64)."""
  if fmt.storage_bits == 4:
    codes = qstate.unpack_4bit(codes)
  if fmt.kind in ("e4m3", "fp16"):
    return np.asarray(codes.astype(jnp.float32), np.float64)
  return np.asarray(qstate.decode(codes, fmt, qstate.code_table(fmt)), np.float64)


def assert_codes_agree_but_ties(got, want, exact, fmt, what="", terms=None):
  """``got`` and ``want`` (BlockQuantized) store ``exact`` (the float32 moment XLA computed):
  scales equal to float32 rounding; a code may differ only where ``exact`` sits on the midpoint
  of the two codes (within ``TIE_RTOL`` of ``terms``, the magnitude of what it is summed from;
  default ``|exact|``); blocks with a NaN scale are not compared (any code times NaN is NaN)."""
  g_scale, w_scale = np.asarray(got.scale), np.asarray(want.scale)
  np.testing.assert_array_equal(np.isnan(g_scale), np.isnan(w_scale), err_msg=f"{what}: NaN scales")
  np.testing.assert_allclose(g_scale, w_scale, rtol=1e-6, atol=0, err_msg=f"{what}: scales")
  block = fmt.block
  finite = np.repeat(np.isfinite(w_scale), block, axis=-1)
  values_got, values_want = _normalized(got.codes, fmt), _normalized(want.codes, fmt)
  x = np.asarray(exact, np.float64)
  scale = np.repeat(np.where(np.isfinite(w_scale), w_scale, 1.0).astype(np.float64), block, axis=-1)
  multiplier = np.where(scale > 0, 1.0 / np.where(scale > 0, scale, 1.0), 0.0)
  y = x * multiplier  # the exact value in code units: maps multiply by 1/amax, floats by fmax/amax
  size = np.abs(y) if terms is None else np.maximum(np.abs(y), np.asarray(terms, np.float64) * multiplier)
  differ = (values_got != values_want) & finite
  gap = np.abs(np.abs(y - values_got) - np.abs(y - values_want))
  bad = differ & (gap > TIE_RTOL * size + 1e-30)
  assert not bad.any(), (f"{what}: {bad.sum()} codes differ beyond a tie", y[bad][:4], values_got[bad][:4],
                         values_want[bad][:4])
  assert differ.mean() <= MAX_TIE_FRACTION, f"{what}: {differ.mean():.2e} of the codes differ"


def _u_bound(g, m, v, coefficients, m_format, v_format, nesterov):
  """``(bound on |u - u_xla|, exact m, exact v, |terms| of m)`` from the step's inputs."""
  gf = g.astype(jnp.float32)
  m_in = qstate.dequantize_blockwise(m, m_format, g.shape)
  v_in = qstate.dequantize_blockwise(v, v_format, g.shape)
  _, m_exact, v_exact = jax.jit(adam_moments, static_argnums=4)(gf, m_in, v_in, coefficients, nesterov)
  # u to a few ulps of the terms it is made of: m_new = (1 - b1) g + b1 m may cancel (an FMA
  # or not moves it by an ulp of its terms), and so may Nesterov's two terms.
  c = jax.tree.map(lambda x: np.float64(np.float32(x)), coefficients)
  g64, m64 = np.asarray(gf, np.float64), np.asarray(m_in, np.float64)
  m_terms = c.one_minus_b1 * np.abs(g64) + c.b1 * np.abs(m64)
  if nesterov:
    terms = c.b1 * m_terms / c.bc1_next + c.one_minus_b1 * np.abs(g64) / c.bc1
  else:
    terms = m_terms / c.bc1
  denominator = np.sqrt(np.asarray(v_exact, np.float64) / c.bc2 + c.eps_root) + c.eps
  return U_RTOL * terms / denominator, m_exact, v_exact, m_terms


def assert_moments_agree(got, want, g, m, v, coefficients, m_format, v_format, nesterov):
  """New moments ``got = (m, v)`` (BlockQuantized) against XLA's ``want``: the same shapes and dtypes,
  codes equal but at ties of the exact float32 moments recomputed from the step's inputs ``g, m,
  v``. Returns the bound on ``|u - u_xla|`` for the same inputs."""
  for new, ref in zip(got, want):
    assert new.codes.shape == ref.codes.shape and new.codes.dtype == ref.codes.dtype
    assert new.scale.shape == ref.scale.shape and new.scale.dtype == jnp.float32
  bound, m_exact, v_exact, m_terms = _u_bound(g, m, v, coefficients, m_format, v_format, nesterov)
  assert_codes_agree_but_ties(got[0], want[0], m_exact, m_format, "m", m_terms)
  assert_codes_agree_but_ties(got[1], want[1], v_exact, v_format, "v")  # no cancellation: both terms >= 0
  return bound


def assert_update_agrees(kernel_out, reference_out, g, m, v, coefficients, m_format, v_format, nesterov):
  """The kernel's ``(u, m, v)`` against XLA's, with the exact float32 moments recomputed from the inputs."""
  u, ru = kernel_out[0], reference_out[0]
  assert u.dtype == jnp.float32 and u.shape == g.shape
  bound = assert_moments_agree(kernel_out[1:], reference_out[1:], g, m, v, coefficients, m_format, v_format, nesterov)
  finite = np.isfinite(np.asarray(ru))
  np.testing.assert_array_equal(np.isfinite(np.asarray(u)), finite)
  err = np.abs(np.asarray(u, np.float64) - np.asarray(ru, np.float64))
  assert np.all(err[finite] <= bound[finite]), np.max(err[finite] / bound[finite])


reference = jax.jit(ak.adam_update_reference, static_argnums=(4, 5, 6))


def assert_kernel_matches_reference(kernel, key, shape, m_format, v_format, nesterov, seeds):
  """``seeds`` fresh draws of ``shape`` (odd draws with bfloat16 gradients, the third with traced
  hyperparameters): ``kernel(g, m, v, c, m_format, v_format, nesterov)`` agrees with XLA's update
  (:func:`assert_update_agrees`)."""
  for seed in range(seeds):
    grad_dtype = jnp.bfloat16 if seed % 2 else jnp.float32  # bf16 parameters' gradients
    g, m, v, c = random_case(jax.random.fold_in(key, seed), shape, m_format, v_format, grad_dtype,
                             hyper_arrays=seed == 2)
    out = kernel(g, m, v, c, m_format, v_format, nesterov)
    want = reference(g, m, v, c, m_format, v_format, nesterov)
    assert_update_agrees(out, want, g, m, v, c, m_format, v_format, nesterov)


def assert_nonfinite_gradients_reach_the_state_as_nan(kernel, key, m_format, v_format, n):
  """NaN, +inf and -inf gradient elements of a ``[4, n]`` tensor make exactly their blocks' moments
  NaN (every other block finite) and exactly their own update elements NaN."""
  g, m, v, c = random_case(key, (4, n), m_format, v_format)
  block = m_format.block
  g = g.at[1, 3].set(jnp.nan).at[2, block + 5].set(jnp.inf).at[3, 7].set(-jnp.inf)
  u, m_new, v_new = kernel(g, m, v, c, m_format, v_format, False)
  bad = np.zeros((4, n // block), bool)
  bad[1, 0] = bad[2, 1] = bad[3, 0] = True
  for q, fmt in ((m_new, m_format), (v_new, v_format)):
    values = np.asarray(qstate.dequantize_blockwise(q, fmt, g.shape)).reshape(4, -1, block)
    assert np.all(np.isnan(values[bad])) and np.all(np.isfinite(values[~bad])), fmt
  assert np.isnan(u[1, 3]) and np.isnan(u[2, block + 5]) and np.isnan(u[3, 7])
  assert np.isfinite(np.asarray(u)).sum() == u.size - 3


def assert_overflowing_gradients_stay_finite(kernel, key, m_format, v_format, n):
  """Finite gradient elements whose square overflows float32 (1e20 up to 3e38, one per row of a
  ``[4, n]`` tensor): the kernel's moments stay finite in every block, as XLA's do, with the same
  codes but at ties of the fitted moments (``fit_moments``), and the same update."""
  g, m, v, c = random_case(key, (4, n), m_format, v_format)
  block = m_format.block
  g = g.at[0, 3].set(1e20).at[1, block + 5].set(-1e25).at[2, 7].set(1e30).at[3, n - 1].set(3e38)
  out = kernel(g, m, v, c, m_format, v_format, False)
  want = reference(g, m, v, c, m_format, v_format, False)
  for q, fmt in zip(out[1:], (m_format, v_format)):
    assert np.all(np.isfinite(np.asarray(qstate.dequantize_blockwise(q, fmt, g.shape)))), fmt
  m32, v32 = (qstate.dequantize_blockwise(q, f, g.shape) for q, f in ((m, m_format), (v, v_format)))
  _, m_new, v_new = adam_moments(g, m32, v32, c)
  m_fit, v_fit = fit_moments(g.astype(jnp.float32), m32, v32, m_new, v_new, c)
  bound, _, _, m_terms = _u_bound(g, m, v, c, m_format, v_format, False)
  assert_codes_agree_but_ties(out[1], want[1], m_fit, m_format, "m", m_terms)
  assert_codes_agree_but_ties(out[2], want[2], v_fit, v_format, "v")
  u, ru = np.asarray(out[0], np.float64), np.asarray(want[0], np.float64)
  assert np.all(np.isfinite(u)) and np.all(np.abs(u - ru) <= bound), np.max(np.abs(u - ru) / bound)


def assert_step_matches_reference(kernel, key, shape, m_format, v_format, seeds):
  """``seeds`` fresh draws: ``kernel(p, g, m, v, c, neg_lr, weight_decay, seed, m_format, v_format)``
  (the fused step) against XLA's step. The moments as :func:`assert_update_agrees` allows; float32
  parameters to the update's tolerance times the learning rate (and an ulp of ``p``); bf16
  parameters, stochastically rounded with the same bits, equal except where float32 rounding of
  the exact new value moves it across a rounding threshold (rare; then by one bf16 ulp)."""
  for seed in range(seeds):
    k1, k2, k3 = jax.random.split(jax.random.fold_in(key, seed), 3)
    param_dtype = jnp.bfloat16 if seed % 2 else jnp.float32
    g, m, v, c = random_case(k1, shape, m_format, v_format, param_dtype)
    p = (jax.random.normal(k2, shape) * 0.02).astype(param_dtype)
    neg_lr, decay = jnp.float32(-1e-3), jnp.float32(0.1 * (seed % 3 != 2))  # every third draw: no decay
    rounding = jax.random.bits(k3, (), jnp.uint32) if param_dtype == jnp.bfloat16 else None
    p_new, *moments = kernel(p, g, m, v, c, neg_lr, decay, rounding, m_format, v_format)
    want = step_reference(p, g, m, v, c, neg_lr, decay, rounding, m_format, v_format)
    assert p_new.dtype == p.dtype and p_new.shape == p.shape
    # The moments: exactly what the update kernel is held to.
    u_err = assert_moments_agree(moments, want[1:], g, m, v, c, m_format, v_format, False)
    got, ref = np.asarray(p_new, np.float64), np.asarray(want[0], np.float64)
    if param_dtype == jnp.float32:
      bound = 1e-3 * u_err + 2.0**-22 * np.abs(ref) + 1e-30  # |neg_lr| = 1e-3; an ulp of p and of the sum
      assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) / bound)
    else:
      differ = got != ref
      ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.maximum(np.abs(ref), np.abs(got)), 1e-30))) - 7)
      # Where p + update nearly cancels, the two float32 sums (each within an ulp of |p|) can round to bf16
      # values of either sign, further apart than the result's own ulp: allow that float32 error too.
      sum_err = 2.0**-22 * np.abs(np.asarray(p, np.float64))
      assert np.all(np.abs(got - ref)[differ] <= (ulp * 1.01 + sum_err)[differ]), \
          "bf16 parameters differ by more than an ulp"
      assert differ.mean() <= 1e-3, f"{differ.mean():.2e} of the bf16 parameters differ"


step_reference = jax.jit(ak.adam_step_reference, static_argnums=(8, 9, 10))
