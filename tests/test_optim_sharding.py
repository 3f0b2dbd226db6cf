"""Low-bit optimizer states wherever a user keeps them: the trainer's FSDP on 2 devices, GSPMD
with Flax logical axis names, nnx.Optimizer, optax.inject_hyperparams; and NaN/inf gradients."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from test_train_loop import corpus, micro_config, restore  # noqa: F401  (fixture)

from helpers import fresh_key, rel_err
from jaxlowbit import optim, qstate
from train import loop

LOWBIT = ["adamw_8bit", "adamw_4bit", "adamw_fp8", "adamw_fp8_o2"]
FORMATS = {  # (m, v) formats of each optimizer, for reading its state back
    "adamw_8bit": (qstate.BlockFormat("dynamic", 8, True, 256), qstate.BlockFormat("dynamic", 8, False, 256)),
    "adamw_4bit": (qstate.BlockFormat("dynamic", 4, True, 128), qstate.BlockFormat("linear", 4, False, 128)),
    "adamw_fp8": (qstate.BlockFormat("e4m3", block=256), qstate.BlockFormat("e4m3", block=256)),
    "adamw_fp8_o2": (qstate.BlockFormat("e4m3", block=256), qstate.BlockFormat("fp16", block=256)),
}


@pytest.mark.parametrize("name", LOWBIT)
def test_the_trainer_runs_every_optimizer_under_fsdp_on_two_devices(name, tmp_path, corpus):  # noqa: F811
  """Was: ``pytree structure error`` in fsdp.init_optimizer (a sharding tree mapped over BlockQuantized)."""
  config = micro_config(corpus, optimizer=name, steps=4, checkpoint_every=2, eval_every=100, mesh__fsdp=2)
  config.model.update(d_model=64, d_ff=128)  # 64 x 128 kernels: 8192 elements, quantized
  result = loop.train(config, tmp_path / name)
  assert result.status == "completed" and np.isfinite(result.loss)
  step, state, _ = restore(tmp_path / name, config)
  adam = state.opt_state[1][0] if isinstance(state.opt_state[1], tuple) else state.opt_state
  codes = [x for x in jax.tree.leaves(state.opt_state) if x.dtype in (jnp.uint8, jnp.float8_e4m3fn)]
  assert step == 4 and codes, f"no quantized moments in the state: {jax.tree.map(jnp.shape, adam)}"


def _logical_model():
  def init(names):
    return nn.with_logical_partitioning(nn.initializers.normal(0.02), names)

  class Attention(nn.Module):
    @nn.compact
    def __call__(self, x):
      y = nn.DenseGeneral((8, 128), use_bias=False, kernel_init=init(("embed", "heads", "kv")))(x)
      return nn.DenseGeneral(512, axis=(-2, -1), use_bias=False, kernel_init=init(("heads", "kv", "embed")))(y)

  return Attention()


@pytest.mark.parametrize("name", LOWBIT)
def test_flax_logical_axis_shardings_apply_to_the_state(name):
  """The Flax/MaxText pattern: specs from ``nn.get_partition_spec`` of ``jax.eval_shape(init)``.
  Was: a (512, 8, 128) kernel's codes lost the parameter's rank, so its 3-name spec did not fit."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))
  rules = (("embed", "fsdp"), ("heads", "tensor"), ("kv", None))
  model, tx = _logical_model(), optim.make(name, 1e-3)
  x = jnp.ones((4, 512))

  # 1. The state's specs straight from the boxed init, as for optax.adamw: the (512, 8, 128) kernel.
  def init_first(key):
    params = {"DenseGeneral_0": model.init(key, x)["params"]["DenseGeneral_0"]}
    return params, tx.init(params)

  specs = nn.get_partition_spec(jax.eval_shape(init_first, jax.random.key(0)))
  _, state = nn.unbox(jax.jit(init_first, out_shardings=nn.logical_to_mesh_sharding(specs, mesh, rules))(
      jax.random.key(0)))
  for tree in (state[0].mu, state[0].nu_scale):
    leaf = tree["DenseGeneral_0"]["kernel"]
    assert leaf.shape[:2] == (512, 8) and leaf.sharding.spec == P("fsdp", "tensor", None)
    assert leaf.addressable_shards[0].data.shape[:2] == (128, 4), "sharded, not replicated"

  # 2. The whole model, whose second kernel (8, 128, 512) splits its last axis 4 ways: 128 weights
  # per device cannot hold a 256-block, so its block scales stay whole (optim.state_shardings).
  abstract = jax.eval_shape(lambda key: model.init(key, x)["params"], jax.random.key(0))
  param_shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
  params = jax.jit(lambda key: nn.unbox(model.init(key, x)["params"]), out_shardings=param_shardings)(
      jax.random.key(0))
  shardings = optim.state_shardings(tx, jax.eval_shape(tx.init, params), param_shardings)
  state = jax.jit(tx.init, out_shardings=shardings)(params)
  out = state[0].mu["DenseGeneral_1"]["kernel"]
  assert out.sharding.spec == P("tensor", None, "fsdp") and out.addressable_shards[0].data.shape[-1] < 512

  key = fresh_key()
  grads = jax.tree.map(lambda p: jax.random.normal(key, p.shape) * 1e-3, params)
  updates, new_state = jax.jit(tx.update, out_shardings=(param_shardings, shardings))(grads, state, params)
  one = jax.devices()[0]
  ref_updates, ref_state = jax.jit(tx.update)(*jax.device_put((grads, state, params), one))
  for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(ref_updates)):
    assert rel_err(a, b) < 1e-6
  for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(ref_state)):
    assert a.shape == b.shape and a.sharding.is_fully_replicated in (True, False)
    if a.dtype == jnp.float32:
      assert rel_err(a, b) < 1e-6


def test_state_shardings_map_parameter_shardings_and_leave_undividable_dims_whole():
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))
  params = {"w": jnp.zeros((64, 512)), "small": jnp.zeros((512, 64)), "norm": jnp.zeros((64,))}
  param_shardings = {"w": NamedSharding(mesh, P("fsdp", "tensor")), "small": NamedSharding(mesh, P(None, "tensor")),
                     "norm": NamedSharding(mesh, P("fsdp"))}
  tx = optim.adamw_8bit(1e-3)
  state = jax.eval_shape(tx.init, params)
  shardings = optim.state_shardings(tx, state, param_shardings)
  adam = shardings[0]
  assert adam.mu["w"].spec == P("fsdp", "tensor") and adam.mu_scale["w"].spec == P("fsdp", "tensor")  # 2 blocks
  assert adam.mu_scale["small"].spec == P(None, None), "one block per row: its scale dim is not split"
  assert adam.count.spec == P() and adam.mu["norm"].spec == P("fsdp")
  placed = jax.jit(tx.init, out_shardings=shardings)(params)  # every sharding fits its leaf
  assert placed[0].mu["w"].addressable_shards[0].data.shape == (16, 256)
  specs = optim.state_shardings(tx, state, {k: s.spec for k, s in param_shardings.items()}, mesh=mesh)
  assert specs[0].mu_scale["small"] == P(None, None) and specs[0].count == P()


@pytest.mark.parametrize("name", LOWBIT)
def test_nnx_optimizer_steps_like_the_functional_optimizer(name):
  """Was: ``TypeError: unsupported operand type(s) for *: 'float' and 'State'`` on the first jitted update."""

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.big = nnx.Linear(128, 64, rngs=rngs)  # 8192 weights: quantized moments
      self.small = nnx.Linear(64, 8, rngs=rngs)

    def __call__(self, x):
      return self.small(jax.nn.relu(self.big(x)))

  tx = optim.make(name, 1e-2)
  model = Model(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  x = jax.random.normal(fresh_key(), (16, 128))

  def loss_fn(model):
    return jnp.mean(model(x) ** 2)

  @nnx.jit
  def nnx_step(model, optimizer):
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  graphdef, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)
  params = nnx.to_pure_dict(params)

  @jax.jit
  def functional_step(params, state):
    def loss(p):
      model = nnx.merge(graphdef, nnx.State(p) if not isinstance(p, nnx.State) else p)
      return loss_fn(model)

    grads = jax.grad(lambda p: loss_fn(_merged(graphdef, p)))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = tx.init(params)
  losses = []
  for _ in range(3):
    losses.append(float(nnx_step(model, optimizer)))
    params, state = functional_step(params, state)
  assert losses[-1] < losses[0]
  ours = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(params)):
    assert rel_err(a, b) < 1e-6
  codes = nnx.to_pure_dict(nnx.state(optimizer.opt_state))
  assert any(leaf.dtype != jnp.float32 for leaf in jax.tree.leaves(codes) if leaf.ndim == 2)


def _merged(graphdef, pure_params):
  state = nnx.State(pure_params)
  return nnx.merge(graphdef, state)


@pytest.mark.parametrize("name", LOWBIT)
def test_inject_hyperparams_changes_the_learning_rate_at_run_time(name):
  """Was: ``block_size must be an even int ... got Array(256)``."""
  factory = optim.OPTIMIZERS[name]
  tx = optax.inject_hyperparams(factory)(learning_rate=1e-3, weight_decay=0.0)
  key = fresh_key()
  params = {"w": jax.random.normal(key, (64, 256)) * 0.02}
  grads = {"w": jax.random.normal(jax.random.fold_in(key, 1), (64, 256)) * 1e-3}
  state = tx.init(params)
  u1, _ = jax.jit(tx.update)(grads, state, params)
  plain, _ = factory(1e-3, weight_decay=0.0).update(grads, factory(1e-3, weight_decay=0.0).init(params), params)
  assert rel_err(u1["w"], plain["w"]) < 1e-4  # float32 betas (injected) against Python floats: ~7e-6
  state.hyperparams["learning_rate"] = jnp.asarray(2e-3)
  u2, _ = jax.jit(tx.update)(grads, state, params)
  np.testing.assert_allclose(u2["w"], 2 * u1["w"], rtol=1e-6)
  with pytest.raises(TypeError, match="static_args"):
    optax.inject_hyperparams(factory)(learning_rate=1e-3, block_size=128).init(params)
  custom = optax.inject_hyperparams(factory, static_args=("block_size",))(learning_rate=1e-3, block_size=128)
  assert custom.init(params).inner_state[0].mu_scale["w"].shape == (64, 2)


@pytest.mark.parametrize("name", LOWBIT)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nonfinite_gradient_reaches_the_state_as_nan(name, bad):
  """Was: a NaN became a finite first moment for every quantized tensor (a plain max drops NaN on CPU)."""
  tx = optim.make(name, 1e-3)
  key = fresh_key()
  shape = (16, 512)
  params = {"w": jax.random.normal(key, shape)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  g = jax.random.normal(jax.random.fold_in(key, 1), shape) * 1e-3
  _, state = update({"w": g}, state, params)  # one finite step first
  row, col = np.random.default_rng().integers(16), np.random.default_rng().integers(512)
  u, state = update({"w": g.at[row, col].set(bad)}, state, params)
  m_fmt, v_fmt = FORMATS[name]
  adam = state[0]
  m = qstate.dequantize_blockwise(qstate.BlockQuantized(adam.mu["w"], adam.mu_scale["w"]), m_fmt, shape)
  v = qstate.dequantize_blockwise(qstate.BlockQuantized(adam.nu["w"], adam.nu_scale["w"]), v_fmt, shape)
  block = slice(col // m_fmt.block * m_fmt.block, (col // m_fmt.block + 1) * m_fmt.block)
  for moment in (m, v):
    assert np.all(np.isnan(np.asarray(moment[row, block]))), "the bad element's block is NaN"
    assert np.isfinite(np.asarray(moment[(row + 1) % 16])).all(), "other rows are untouched"
  assert not np.isfinite(float(u["w"][row, col]))
