"""The fused low-bit Adam update (pallas_kernels.adam) on CPU: the kernel in Pallas interpret mode
against XLA's update on fresh inputs, its dispatch, its GSPMD partitioning on 8 CPU devices, and
its Triton lowering for sm90. The real kernel on a GPU: tests/test_optim_gpu.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from helpers import fresh_key
from jaxlowbit import optim, qstate
from jaxlowbit.qstate import BlockFormat, BlockQuantized
from jaxlowbit_numerics.adam import adam_coefficients
from optim_kernel_common import (FORMATS, assert_kernel_matches_reference, assert_moments_agree,
                                 assert_nonfinite_gradients_reach_the_state_as_nan,
                                 assert_overflowing_gradients_stay_finite, assert_step_matches_reference,
                                 assert_update_agrees, random_case, reference)
from pallas_kernels import adam as ak
from pallas_kernels import dispatch, policy

pytestmark = pytest.mark.timeout(300)  # interpret mode is slow; nothing may hang CI

SEEDS = 3  # fresh inputs per test; each draw is checked on its own
interpret_kernel = functools.partial(ak.adam_update_kernel, interpret=True)
interpret_step = functools.partial(ak.adam_step_kernel, interpret=True)


@pytest.mark.parametrize("nesterov", [False, True], ids=["adam", "nesterov"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_kernel_matches_xla_update_interpret(name, nesterov):
  assert_kernel_matches_reference(interpret_kernel, fresh_key(), (3, 4, 512), *FORMATS[name], nesterov, SEEDS)


@pytest.mark.parametrize("name", list(FORMATS))
def test_step_kernel_writes_the_parameter_as_xla_does_interpret(name):
  """The fused step (moments and parameter in one kernel): float32 and stochastically rounded
  bf16 parameters against XLA's step on fresh inputs."""
  assert_step_matches_reference(interpret_step, fresh_key(), (2, 4, 512), *FORMATS[name], SEEDS)


@pytest.mark.parametrize("name", list(FORMATS))
def test_nonfinite_gradients_reach_the_state_as_nan(name):
  assert_nonfinite_gradients_reach_the_state_as_nan(interpret_kernel, fresh_key(), *FORMATS[name], 512)


@pytest.mark.parametrize("name", list(FORMATS))
def test_overflowing_gradients_stay_finite_as_in_xla(name):
  assert_overflowing_gradients_stay_finite(interpret_kernel, fresh_key(), *FORMATS[name], 512)


def test_supported_shapes_and_a_clear_error():
  m_format, v_format = FORMATS["8bit"]

  def case(shape, fmt_m=m_format, fmt_v=v_format, dtype=jnp.float32):
    g = jnp.zeros(shape, dtype)
    return g, qstate.zeros_blockwise(shape, fmt_m), qstate.zeros_blockwise(shape, fmt_v), fmt_m, fmt_v

  assert ak.supported(*case((4, 512)))
  assert ak.supported(*case((2, 3, 256), dtype=jnp.bfloat16))
  assert ak.supported(*case((8192,)))
  assert not ak.supported(*case((4, 384))), "a short last block: XLA"
  assert not ak.supported(*case((4, 100))), "one short block per row: XLA"
  odd = BlockFormat("dynamic", 8, True, 96), BlockFormat("dynamic", 8, False, 96)
  assert not ak.supported(*case((4, 192), *odd)), "blocks are powers of two"
  g, m, v, fm, fv = case((4, 512))
  assert not ak.supported(g, m, BlockQuantized(v.codes, v.scale[:, :1]), fm, fv), "scales of another shape"
  e4m3 = BlockFormat("e4m3")
  for v_fmt in (BlockFormat("e5m2", nonzero=True), BlockFormat("e4m3", nonzero=True, sqrt=True)):
    assert not ak.supported(*case((4, 512), e4m3, v_fmt)), f"{v_fmt}: not checked on a GPU, XLA's update"
  with pytest.raises(ValueError, match="power-of-two block.*dispatch.adam_update"):
    ak.adam_update_kernel(*case((4, 384))[:3], adam_coefficients(0.9, 0.999, 1e-8, 0.0, 1, 2), m_format, v_format)


@pytest.mark.parametrize(
    "major, kinds, env, expected",
    [
        (None, ("dynamic", "dynamic"), None, False),  # CPU
        (8, ("dynamic", "linear"), None, True),  # auto: 4-bit measured faster on the kernel
        (9, ("dynamic", "dynamic"), None, True),  # auto: every kind measured faster on the kernel
        (8, ("dynamic", "linear"), "pallas", True),  # Ampere: Triton
        (8, ("e4m3", "fp16"), None, False),  # e4m3 casts need sm89+
        (9, ("e4m3", "e4m3"), None, True),
        (9, ("dynamic", "dynamic"), "xla", False),
        (9, ("dynamic", "dynamic"), "pallas", True),
        (None, ("dynamic", "dynamic"), "pallas", False),  # forced, but no kernel here: XLA
    ],
)
def test_policy(major, kinds, env, expected, monkeypatch):
  monkeypatch.setattr(policy, "compute_capability", lambda device=None: major)
  if env is None:
    monkeypatch.delenv(policy.BACKEND_ENV, raising=False)
  else:
    monkeypatch.setenv(policy.BACKEND_ENV, env)
  assert policy.adam_on_kernel(kinds, policy.requested_backend()) is expected


def _params(key):
  k = jax.random.split(key, 4)
  return {
      "kernel": jax.random.normal(k[0], (16, 512)) * 0.02,  # the kernel
      "stacked": jax.random.normal(k[1], (2, 8, 256)) * 0.02,  # the kernel, leading axes
      "ragged": jax.random.normal(k[2], (16, 320)) * 0.02,  # a short last block (of 256 or 128): XLA
      "norm": jnp.ones((512,)),  # < 4096 elements: float32 moments
      "bf16": (jax.random.normal(k[3], (8, 512)) * 0.02).astype(jnp.bfloat16),  # the kernel, bf16 gradient
  }


@pytest.mark.parametrize("name", ["8bit", "4bit"])
def test_optimizer_takes_the_kernel_where_it_fits(name, monkeypatch):
  """scale_by_adam_quantized with the GPU policy (kernel in interpret mode): the supported leaves
  run the kernel, the others XLA, and two steps match the XLA-only transformation's."""
  calls = []

  def recording(g, m, v, c, m_format, v_format, nesterov, config):
    calls.append(g.shape)
    return interpret_kernel(g, m, v, c, m_format, v_format, nesterov, config)

  key = fresh_key()
  params = _params(key)
  m_format, v_format = FORMATS[name]
  tx = optim.scale_by_adam_quantized(m_format, v_format)
  state = tx.init(params)
  for step in range(2):
    grads = jax.tree.map(lambda p, k=jax.random.fold_in(key, step): (jax.random.normal(k, p.shape) * 1e-3).astype(
        p.dtype), params)
    monkeypatch.setattr(policy, "adam_on_kernel", lambda kinds, backend: False)
    want_u, want = tx.update(grads, state)
    monkeypatch.setattr(policy, "adam_on_kernel", lambda kinds, backend: True)
    monkeypatch.setattr(ak, "adam_update_kernel", recording)
    calls.clear()
    u, new = tx.update(grads, state)
    monkeypatch.undo()
    assert sorted(calls) == sorted([(16, 512), (2, 8, 256), (8, 512)]), calls
    c = adam_coefficients(0.9, 0.999, 1e-8, 0.0, new.count, new.count + 1)
    moments = lambda s, leaf: (BlockQuantized(s.mu[leaf], s.mu_scale[leaf]), BlockQuantized(s.nu[leaf],  # noqa: E731
                                                                                           s.nu_scale[leaf]))
    for leaf in ("kernel", "stacked", "bf16"):
      assert_update_agrees((u[leaf], *moments(new, leaf)), (want_u[leaf], *moments(want, leaf)), grads[leaf],
                           *moments(state, leaf), c, m_format, v_format, False)
    for leaf in ("ragged", "norm"):  # XLA in both runs
      np.testing.assert_array_equal(u[leaf], want_u[leaf])
      for a, b in zip(moments(new, leaf), moments(want, leaf)):
        np.testing.assert_array_equal(a.codes, b.codes)
    state = new


def _mesh(axis_type=AxisType.Auto):
  if jax.device_count() < 8:  # tests/conftest.py provides 8 CPU devices; a GPU host may have fewer
    pytest.skip(f"needs 8 devices, this host has {jax.device_count()}")
  return jax.make_mesh((8,), ("x",), axis_types=(axis_type,))


@pytest.mark.parametrize("spec", [P("x", None), P(None, "x")], ids=["rows", "blocks"])
def test_gspmd_runs_the_kernel_on_each_devices_blocks(spec):
  """Sharded (GSPMD) operands: each device updates its own blocks (no all-gather in the compiled
  step), and the result agrees with the unsharded kernel's (the per-device program is compiled
  apart, and XLA:CPU may contract ``a * b + c`` into an FMA differently: ulps, codes equal but at ties)."""
  mesh = _mesh()
  m_format, v_format = FORMATS["8bit"]
  g, m, v, c = random_case(fresh_key(), (16, 8 * 256), m_format, v_format)  # 8 blocks per row: one per device
  step = jax.jit(lambda g, m, v: interpret_kernel(g, m, v, c, m_format, v_format))
  want = step(g, m, v)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
  args = (put(g), BlockQuantized(put(m.codes), put(m.scale)), BlockQuantized(put(v.codes), put(v.scale)))
  got = step(*args)
  assert "all-gather" not in step.lower(*args).compile().as_text()
  assert got[1].codes.sharding.spec == spec and got[0].sharding.is_equivalent_to(args[0].sharding, 2)
  assert_update_agrees(got, want, g, m, v, c, m_format, v_format, False)


def test_gspmd_step_writes_each_devices_parameter_blocks():
  """The fused step under GSPMD: each device writes its own rows of the parameter (no all-gather),
  as the unsharded step does (to the FMA contractions of a program compiled apart, as above)."""
  mesh = _mesh()
  m_format, v_format = FORMATS["4bit"]
  g, m, v, c = random_case(fresh_key(), (16, 2 * 128), m_format, v_format)
  p = jax.random.normal(fresh_key(), g.shape) * 0.02
  step = jax.jit(lambda p, g, m, v: interpret_step(p, g, m, v, c, -1e-3, 0.1, None, m_format, v_format))
  want = step(p, g, m, v)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("x", None)))  # noqa: E731
  args = (put(p), put(g), BlockQuantized(put(m.codes), put(m.scale)), BlockQuantized(put(v.codes), put(v.scale)))
  got = step(*args)
  assert "all-gather" not in step.lower(*args).compile().as_text()
  assert got[0].sharding.is_equivalent_to(args[0].sharding, 2)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-9)
  assert_moments_agree(got[1:], want[1:], g, m, v, c, m_format, v_format, False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(FORMATS))
def test_kernel_lowers_to_triton_for_sm90(name):
  """Every format through Pallas' Triton lowering (catches primitives Triton cannot take), plain,
  Nesterov with a bf16 gradient, inside shard_map (check_vma on, as jaxlowbit.fsdp runs) and
  under GSPMD shardings."""
  if jax.default_backend() != "cpu":
    pytest.skip("lowers for CUDA from a CPU host; on a GPU tests/test_optim_gpu.py runs the kernel")
  m_format, v_format = FORMATS[name]
  shape = (16, 1024)

  def abstract(fmt, sharding=None):
    codes, scale = qstate.stored_shapes(shape, fmt)
    return BlockQuantized(jax.ShapeDtypeStruct(codes, fmt.code_dtype, sharding=sharding),
                          jax.ShapeDtypeStruct(scale, jnp.float32, sharding=sharding))

  c = adam_coefficients(0.9, 0.999, 1e-8, 0.0, jnp.int32(3), jnp.int32(4))
  for nesterov, dtype in ((False, jnp.float32), (True, jnp.bfloat16)):
    fn = jax.jit(lambda g, m, v, n=nesterov: ak.adam_update_kernel(g, m, v, c, m_format, v_format, n))
    text = fn.trace(jax.ShapeDtypeStruct(shape, dtype), abstract(m_format), abstract(v_format)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "jaxlowbit_adam_update" in text
  for param_dtype, seed in ((jnp.float32, None), (jnp.bfloat16, jnp.uint32(7))):  # the fused step
    fn = jax.jit(lambda p, g, m, v, s=seed: ak.adam_step_kernel(p, g, m, v, c, -1e-3, 0.1, s, m_format, v_format))
    text = fn.trace(jax.ShapeDtypeStruct(shape, param_dtype), jax.ShapeDtypeStruct(shape, param_dtype),
                    abstract(m_format), abstract(v_format)).lower(lowering_platforms=("cuda",)).as_text()
    assert "jaxlowbit_adam_step" in text
  mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,))

  def local(g, mc, ms, vc, vs):
    u, m_new, v_new = ak.adam_update_kernel(g, BlockQuantized(mc, ms), BlockQuantized(vc, vs), c, m_format, v_format)
    assert jax.typeof(u).mat.varying == {"x"}
    return u, *m_new, *v_new

  sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  args = (jax.ShapeDtypeStruct(shape, jnp.float32), *abstract(m_format), *abstract(v_format))
  assert "jaxlowbit_adam_update" in sharded.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  rows = NamedSharding(mesh, P("x"))
  gspmd = jax.jit(lambda g, m, v: ak.adam_update_kernel(g, m, v, c, m_format, v_format))
  g = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rows)
  # Under GSPMD the call lowers to a custom_partitioning call; its per-device Triton kernel is
  # compiled by the SPMD partitioner, which needs a CUDA backend (tests/test_optim_gpu.py).
  assert "CustomSPMDPartitioning" in gspmd.trace(g, abstract(m_format, rows), abstract(v_format, rows)).lower(
      lowering_platforms=("cuda",)).as_text()


def test_dispatch_runs_xla_on_cpu_and_for_explicit_shardings(monkeypatch):
  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU choice; on a GPU tests/test_optim_gpu.py checks the kernel's")
  m_format, v_format = FORMATS["fp8"]
  g, m, v, c = random_case(fresh_key(), (8, 512), m_format, v_format)
  monkeypatch.setattr(ak, "adam_update_kernel", None)  # any call of the kernel would fail
  want = reference(g, m, v, c, m_format, v_format, False)
  got = jax.jit(lambda g, m, v: dispatch.adam_update(g, m, v, c, m_format, v_format))(g, m, v)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
  monkeypatch.setattr(policy, "adam_on_kernel", lambda kinds, backend: True)
  mesh = _mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("x")))  # noqa: E731
    got = jax.jit(lambda g, m, v: dispatch.adam_update(g, m, v, c, m_format, v_format))(
        put(g), jax.tree.map(put, m), jax.tree.map(put, v))
  np.testing.assert_array_equal(got[1].codes, want[1].codes)
