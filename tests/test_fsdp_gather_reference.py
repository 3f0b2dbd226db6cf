"""FSDP's weight gather against the unsharded weight: for every scaling, the weight gathered from 8
shards (scales reduced inside the gather, ``scale=None``) is the whole weight quantized at once,
codes exact; ``global_scale`` reduces over every shard. 8 virtual CPU devices (tests/conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from helpers import fresh_key
from jaxlowbit import fsdp
from jaxlowbit.scaling import WeightScaling

SHARDS = 8
K, N = 128, 48  # 16 rows per shard; a multiple of 4 so ternary shards pack


def _weight(key):
  """float32 ``[K, N]`` with one outlier per shard at a different size, so every shard's local
  statistic differs from the whole weight's."""
  w = np.array(jax.random.normal(key, (K, N)), np.float32)
  for shard in range(SHARDS):
    w[shard * (K // SHARDS), shard % N] *= 2.0 + shard
  return jnp.asarray(w)


def _mesh():
  return Mesh(np.array(jax.devices()[:SHARDS]), ("fsdp",))


def _leaves(gathered):
  """The arrays a gathered weight carries: codes and scales per layout (or the array itself)."""
  if isinstance(gathered, jax.Array):
    return {"weight": gathered}
  out = {}
  for name in ("rows", "transposed"):
    matrix = getattr(gathered, name)
    if matrix is not None:
      out[f"{name}.codes"], out[f"{name}.scale"] = matrix.data, matrix.scale
  return out


@pytest.mark.parametrize("scaling", list(WeightScaling), ids=lambda s: s.value)
def test_gather_with_scale_none_equals_gathering_the_whole_weight(scaling):
  w = _weight(fresh_key())
  whole = _leaves(fsdp.gather_weight(w, scaling, jnp.float32))

  def gather(local):
    return _leaves(fsdp.gather_weight(local, scaling, jnp.float32, axis_name="fsdp"))

  out_specs = jax.tree.map(lambda _: P(), whole)
  sharded = jax.jit(jax.shard_map(gather, mesh=_mesh(), in_specs=P("fsdp", None), out_specs=out_specs,
                                  check_vma=False))(w)
  assert set(sharded) == set(whole) and whole
  for name, want in whole.items():
    got = sharded[name]
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape)
    if scaling is WeightScaling.TERNARY and name.endswith("scale"):
      # mean |W| summed per shard and then across shards: float32 rounding of the order only
      np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=name)
    elif scaling is WeightScaling.TERNARY:
      s = float(np.asarray(whole["rows.scale"]).reshape(-1)[0]) if "rows.scale" in whole else None
      tie = np.abs(np.abs(np.asarray(w) / s) - 0.5) < 1e-5 if s else np.zeros(w.shape, bool)
      codes_got, codes_want = (np.asarray(a.astype(jnp.float32)) for a in (got, want))
      tie = tie if codes_got.shape == tie.shape else tie.T
      assert np.all((codes_got == codes_want) | tie), name
    else:
      np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)),
                                    err_msg=name)


@pytest.mark.parametrize("scaling", [s for s in WeightScaling if s.quantized], ids=lambda s: s.value)
def test_global_scale_reduces_over_every_shard(scaling):
  w = _weight(fresh_key())
  want = fsdp.global_scale(w, scaling, None)
  got = jax.jit(jax.shard_map(lambda local: fsdp.global_scale(local, scaling, "fsdp"), mesh=_mesh(),
                              in_specs=P("fsdp", None), out_specs=P(), check_vma=False))(w)
  np.testing.assert_allclose(got, want, rtol=1e-6 if scaling is WeightScaling.TERNARY else 0, atol=0)
