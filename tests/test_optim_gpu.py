"""The fused low-bit Adam update (pallas_kernels.adam) on the GPU (marker ``gpu``; skipped on CPU):
the compiled Triton kernel against XLA's update on fresh inputs, NaN propagation, the optimizer's
dispatch choosing it, and its GSPMD partitioning on every GPU of the host. The same checks in
interpret mode on CPU: tests/test_optim_kernel.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from helpers import fresh_key
from jaxlowbit import optim
from jaxlowbit.qstate import BlockQuantized
from optim_kernel_common import (FORMATS, assert_kernel_matches_reference, assert_step_matches_reference,
                                 assert_nonfinite_gradients_reach_the_state_as_nan,
                                 assert_overflowing_gradients_stay_finite, random_case)
from pallas_kernels import adam as ak
from pallas_kernels import dispatch, policy

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

SEEDS = 4
kernel = jax.jit(ak.adam_update_kernel, static_argnums=(4, 5, 6))
step_kernel = jax.jit(ak.adam_step_kernel, static_argnums=(8, 9))


def _takes_kernel(name):
  """Skip where the policy keeps the format on XLA (e4m3 states before Hopper)."""
  m_format, v_format = FORMATS[name]
  if not policy.adam_kernel_runs((m_format.kind, v_format.kind)):
    pytest.skip(f"{name}: the policy keeps this format on XLA on this GPU (sm{policy.compute_capability()}x)")
  return m_format, v_format


@pytest.mark.parametrize("shape", [(64, 4096), (2, 22, 2048), (8192,)], ids=str)
@pytest.mark.parametrize("nesterov", [False, True], ids=["adam", "nesterov"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_kernel_matches_xla_update(name, nesterov, shape):
  assert_kernel_matches_reference(kernel, fresh_key(), shape, *_takes_kernel(name), nesterov, SEEDS)


@pytest.mark.parametrize("shape", [(64, 4096), (2, 22, 2048)], ids=str)
@pytest.mark.parametrize("name", list(FORMATS))
def test_step_kernel_writes_the_parameter_as_xla_does(name, shape):
  """The fused step on the GPU: float32 and stochastically rounded bf16 parameters."""
  assert_step_matches_reference(step_kernel, fresh_key(), shape, *_takes_kernel(name), SEEDS)


def _kernel_and_xla(name, step, kernel_name, monkeypatch):
  """adamw_<name> on ``w [256, 1024]`` (quantized) and ``b [1024]`` (float32 moments): ``step(tx,
  params, state, grads)`` jitted under JAXLOWBIT_BACKEND=pallas, which must contain ``kernel_name``,
  and =xla, which must not; returns both outputs."""
  _takes_kernel(name)
  key = fresh_key()
  params = {"w": jax.random.normal(key, (256, 1024)) * 0.02, "b": jnp.zeros((1024,))}
  grads = jax.tree.map(lambda p: jax.random.normal(jax.random.fold_in(key, 1), p.shape) * 1e-3, params)
  tx = optim.make(f"adamw_{name}", 1e-3, weight_decay=0.1)
  state = tx.init(params)
  outs = []
  for backend in ("pallas", "xla"):  # a new function per backend:
    monkeypatch.setenv(policy.BACKEND_ENV, backend)  # the policy is read while tracing
    fn = jax.jit(lambda p, s, g: step(tx, p, s, g))
    ran = kernel_name in fn.lower(params, state, grads).as_text()
    assert ran == (backend == "pallas"), f"{kernel_name} {'did not run' if not ran else 'ran'} under {backend}"
    outs.append(fn(params, state, grads))
  return outs


@pytest.mark.parametrize("name", ["8bit", "4bit", "fp8"])
def test_apply_step_runs_the_step_kernel(name, monkeypatch):
  """optim.apply_step under jit on a GPU: the step kernel writes the parameter, and the result
  agrees with the XLA step's (JAXLOWBIT_BACKEND=xla)."""
  (p, new), (want_p, want) = _kernel_and_xla(
      name, lambda tx, p, s, g: optim.apply_step(tx, g, s, p), "jaxlowbit_adam_step", monkeypatch)
  np.testing.assert_array_equal(p["b"], want_p["b"])
  # lr 1e-3: a step moves w by ~1e-3; a moment code flipped at a tie moves its element's step by ~1%.
  diff = np.abs(np.asarray(p["w"]) - np.asarray(want_p["w"]))
  assert diff.max() <= 2e-5 and np.mean(diff > 1e-8) <= 1e-3, (diff.max(), np.mean(diff > 1e-8))
  for got, ref in ((new[0].mu["w"], want[0].mu["w"]), (new[0].nu["w"], want[0].nu["w"])):
    assert np.mean(np.asarray(got) != np.asarray(ref)) <= 1e-3


@pytest.mark.parametrize("name", list(FORMATS))
def test_nonfinite_gradients_reach_the_state_as_nan(name):
  assert_nonfinite_gradients_reach_the_state_as_nan(kernel, fresh_key(), *_takes_kernel(name), 1024)


@pytest.mark.parametrize("name", list(FORMATS))
def test_overflowing_gradients_stay_finite_as_in_xla(name):
  assert_overflowing_gradients_stay_finite(kernel, fresh_key(), *_takes_kernel(name), 1024)


@pytest.mark.parametrize("name", ["8bit", "4bit", "fp8"])
def test_optimizer_step_runs_the_kernel(name, monkeypatch):
  """adamw_* under jit on a GPU: the step contains the kernel, and it agrees with the XLA update's
  step (JAXLOWBIT_BACKEND=xla) to the kernel's tolerance on the quantized leaf."""
  (u, new), (want_u, want) = _kernel_and_xla(
      name, lambda tx, p, s, g: tx.update(g, s, p), "jaxlowbit_adam_update", monkeypatch)
  np.testing.assert_array_equal(u["b"], want_u["b"])  # < 4096 elements: float32 moments, XLA in both
  np.testing.assert_allclose(u["w"], want_u["w"], rtol=1e-5, atol=1e-12)
  for got, ref in ((new[0].mu["w"], want[0].mu["w"]), (new[0].nu["w"], want[0].nu["w"])):
    differ = np.mean(np.asarray(got) != np.asarray(ref))
    assert differ <= 1e-3, f"{differ:.2e} of the codes differ (ties only expected)"


def test_gspmd_each_gpu_updates_its_blocks():
  """Parameters sharded over every GPU of the host: the compiled step has no all-gather and equals
  the unsharded kernel's."""
  n = jax.device_count()
  if n < 2:
    pytest.skip("one GPU: nothing to partition")
  mesh = jax.make_mesh((n,), ("x",), axis_types=(AxisType.Auto,))
  m_format, v_format = _takes_kernel("8bit")
  g, m, v, c = random_case(fresh_key(), (8 * n, 4096), m_format, v_format)
  step = jax.jit(lambda g, m, v: ak.adam_update_kernel(g, m, v, c, m_format, v_format))
  want = step(g, m, v)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("x")))  # noqa: E731
  args = (put(g), BlockQuantized(put(m.codes), put(m.scale)), BlockQuantized(put(v.codes), put(v.scale)))
  got = step(*args)
  assert "all-gather" not in step.lower(*args).compile().as_text()
  np.testing.assert_allclose(got[0], want[0], rtol=2e-6, atol=0)
  for a, b in zip(jax.tree.leaves(got[1:]), jax.tree.leaves(want[1:])):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name, backend, fused", [("fp8", "auto", True), ("4bit", "auto", True),
                                                  ("8bit", "auto", True), ("8bit", "xla", False)])
def test_dispatch_picks_the_kernel_here(name, backend, fused, monkeypatch):
  """auto: the kernel for every state kind (measured faster than XLA); xla: XLA's update."""
  m_format, v_format = _takes_kernel(name)
  monkeypatch.setenv(policy.BACKEND_ENV, backend)
  g, m, v, c = random_case(fresh_key(), (16, 1024), m_format, v_format)
  text = jax.jit(lambda g, m, v: dispatch.adam_update(g, m, v, c, m_format, v_format)).lower(g, m, v).as_text()
  assert ("jaxlowbit_adam_update" in text) is fused
