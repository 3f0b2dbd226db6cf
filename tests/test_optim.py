"""Low-bit AdamW (jaxlowbit.optim): state bytes, updates against optax.adamw, composition,
FSDP sharding, convergence and argument errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxlowbit import optim, qstate
from helpers import fresh_key, rel_err

LOWBIT = ["adamw_8bit", "adamw_4bit", "adamw_fp8", "adamw_fp8_o2"]
# Norm-wise relative error of each step's update against optax.adamw on the same gradients,
# worst over 10 steps; measured over 6 seeds: 8-bit 0.035, fp8 0.051, fp8_o2 0.045, 4-bit 0.498
# (4 bits: m has 7 magnitudes, and v's linear map rounds everything below amax/16 up to it).
UPDATE_RTOL = {"adamw_8bit": 0.05, "adamw_fp8": 0.075, "adamw_fp8_o2": 0.065, "adamw_4bit": 0.6}


def _params(key):
  k1, k2, k3 = jax.random.split(key, 3)
  return {
      "kernel": jax.random.normal(k1, (128, 512)) * 0.02,  # blocks along the last axis
      "heads": jax.random.normal(k2, (32, 8, 64)) * 0.02,  # last axis 64 < block: one short block per row
      "norm": jnp.ones((512,)),  # < 4096 elements: float32 moments
      "odd": jax.random.normal(k3, (100, 51)) * 0.02,  # odd rows: 8-bit/FP8 blocks of 51, 4-bit float32
  }


def _grad_sequence(key, params, steps):
  """``steps`` fresh gradient trees (stacked on a leading axis), each column scaled by one of
  ``logspace(-4, -3)`` like real gradients. One random draw for all: cheap to compile."""
  leaves, treedef = jax.tree.flatten(params)
  sizes = [p.size for p in leaves]
  flat = jax.random.normal(key, (steps, sum(sizes)))
  out, start = [], 0
  for p, n in zip(leaves, sizes):
    g = flat[:, start : start + n].reshape(steps, *p.shape)
    out.append(g * jnp.logspace(-4, -3, p.shape[-1]))
    start += n
  return jax.tree.unflatten(treedef, out)


def _trajectory(tx, params, key, steps):
  """(final params, final state, [updates of each step]) of ``steps`` steps, one jitted scan."""
  grads = _grad_sequence(key, params, steps)

  @jax.jit
  def run(params, grads):
    def step(carry, g):
      params, state = carry
      u, state = tx.update(g, state, params)
      return (optax.apply_updates(params, u), state), u

    (params, state), updates = jax.lax.scan(step, (params, tx.init(params)), grads)
    return params, state, updates

  params, state, updates = run(params, grads)
  return params, state, [jax.tree.map(lambda u, t=t: u[t], updates) for t in range(steps)]


TRACK_KW = dict(learning_rate=1e-3, weight_decay=0.1)


@functools.cache
def _tracking_reference():
  """(key, params, optax.adamw's updates): fresh per session, shared by the optimizers' tests."""
  key = fresh_key()
  params = _params(key)
  return key, params, _trajectory(optax.adamw(**TRACK_KW), params, key, 10)[2]


@pytest.mark.parametrize("name", LOWBIT)
def test_updates_track_optax_adamw(name):
  key, params, ref = _tracking_reference()
  _, state, ours = _trajectory(optim.make(name, **TRACK_KW), params, key, 10)
  for t, (u, r) in enumerate(zip(ours, ref)):
    quantized = ("kernel", "heads") if name == "adamw_4bit" else ("kernel", "heads", "odd")
    for leaf in quantized:
      err = rel_err(u[leaf], r[leaf])
      assert err <= (1e-6 if t == 0 else UPDATE_RTOL[name]), (t, leaf, err)  # step 1 uses float32 moments
    for leaf in set(params) - set(quantized):  # unquantized tensors: optax.adamw bit for bit
      np.testing.assert_array_equal(u[leaf], r[leaf])
  adam = state[0]
  for leaf in quantized:  # every state leaf keeps its parameter's rank and leading shape
    assert adam.mu[leaf].dtype != jnp.float32 and adam.mu[leaf].shape[:-1] == params[leaf].shape[:-1]
    assert adam.mu_scale[leaf].shape[:-1] == params[leaf].shape[:-1] and adam.mu_scale[leaf].dtype == jnp.float32
  assert adam.mu["heads"].shape == ((32, 8, 32) if name == "adamw_4bit" else (32, 8, 64))
  assert adam.mu_scale["heads"].shape == (32, 8, 1) and adam.nu_scale["kernel"].shape[-1] == 512 // (
      128 if name == "adamw_4bit" else 256)
  assert adam.mu["norm"].dtype == jnp.float32 and adam.mu_scale["norm"].shape == (512 // (128 if name == "adamw_4bit" else 256),), "small: float32"
  assert np.all(np.asarray(adam.mu_scale["norm"]) == 1.0), "with unit scales"


# The e5m2 second moments of issue 13 (docs/optim.md, "MS-AMP questions"; not shipped): format of v,
# and a bound on the update error above its measured worst over 6 seeds (0.064 and 0.096).
E5M2_V = {
    "v": (qstate.BlockFormat("e5m2", nonzero=True), 0.09),
    "sqrt_v": (qstate.BlockFormat("e5m2", nonzero=True, sqrt=True), 0.13),
}


@pytest.mark.parametrize("which", list(E5M2_V))
def test_e5m2_second_moment_tracks_optax_adamw_as_measured(which):
  v_format, bound = E5M2_V[which]
  key, params, ref = _tracking_reference()
  tx = optim.adamw_quantized(qstate.BlockFormat("e4m3"), v_format, TRACK_KW["learning_rate"],
                             weight_decay=TRACK_KW["weight_decay"])
  _, state, ours = _trajectory(tx, params, key, 10)
  assert state[0].nu["kernel"].dtype == jnp.float8_e5m2
  errors = [rel_err(u[leaf], r[leaf]) for u, r in zip(ours, ref) for leaf in ("kernel", "heads", "odd")]
  assert max(errors) <= bound, max(errors)


def _model_shapes():
  """A 16.8M-parameter transformer's shapes (vocab 8192, d 512, 4 layers, MLP 2048)."""
  d, hidden, vocab, layers = 512, 2048, 8192, 4
  shapes = {"embed": (vocab, d), "final_norm": (d,)}
  for i in range(layers):
    shapes.update({
        f"l{i}.qkv": (d, 3 * d), f"l{i}.o": (d, d), f"l{i}.up": (d, hidden), f"l{i}.down": (hidden, d),
        f"l{i}.norm1": (d,), f"l{i}.norm2": (d,),
    })  # fmt: skip
  return {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}


@pytest.mark.parametrize(
    "name,limit", [("adamw_8bit", 0.27), ("adamw_4bit", 0.15), ("adamw_fp8", 0.27), ("adamw_fp8_o2", 0.40)]
)
def test_state_bytes(name, limit):
  params = _model_shapes()
  n_params = sum(np.prod(p.shape) for p in params.values())
  assert n_params >= 10_000_000
  ours = qstate.nbytes(jax.eval_shape(optim.make(name, 1e-3).init, params))
  ref = qstate.nbytes(jax.eval_shape(optax.adamw(1e-3).init, params))
  assert ours <= limit * ref, ours / ref


def test_composes_with_chain_clip_schedule_and_multisteps():
  key = fresh_key()
  params = _params(key)
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 3, 20)

  def build(adamw):
    return optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1e-3), adamw(schedule, weight_decay=0.1)), 2)

  p_ours, state, _ = _trajectory(build(optim.adamw_8bit), params, key, 8)
  p_ref, _, _ = _trajectory(build(optax.adamw), params, key, 8)
  assert int(state.gradient_step) == 4
  for leaf in params:
    delta_ours, delta_ref = p_ours[leaf] - params[leaf], p_ref[leaf] - params[leaf]
    assert rel_err(delta_ours, delta_ref) < UPDATE_RTOL["adamw_8bit"], leaf


@pytest.mark.parametrize("name", LOWBIT)
def test_apply_step_is_the_unfused_step(name):
  """optim.apply_step (the fused step: clip, schedule, mask and AdamW written into the parameters)
  against tx.update + optax.apply_updates over 3 steps: the same state structure (checkpoints
  load either way), the same moments but at rare ties, parameters to float32 rounding."""
  key = fresh_key()
  params = _params(key)
  mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731  (the optax docs' pattern: needs shapes)
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 10)
  tx = optim.chain(optax.clip_by_global_norm(1.0), optim.make(name, schedule, weight_decay=0.1, mask=mask))
  assert tx.fused_step is not None
  fused = jax.jit(lambda g, s, p: optim.apply_step(tx, g, s, p))
  unfused = jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
  (p1, s1), (p2, s2) = (params, tx.init(params)), (params, tx.init(params))
  for step in range(3):
    grads = jax.tree.map(lambda p, k=jax.random.fold_in(key, step): jax.random.normal(k, p.shape), params)
    p1, s1 = fused(grads, s1, p1)
    p2, s2 = unfused(grads, s2, p2)
  assert jax.tree.structure(s1) == jax.tree.structure(s2)
  flipped = False
  for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
    assert a.dtype == b.dtype and np.mean(np.asarray(a) != np.asarray(b)) <= 1e-3
    flipped |= not np.array_equal(np.asarray(a), np.asarray(b))
  for leaf in params:
    moved = np.max(np.abs(np.asarray(p2[leaf]) - np.asarray(params[leaf])))
    assert moved > 0
    # Float32 rounding, where every moment code agrees; a code that flipped at a tie moves its element's update by
    # one code step (~1% of the update at 8 bits, up to ~30% at 4): then the few elements it touched may differ by
    # up to that, and the next line bounds how many.
    np.testing.assert_allclose(p1[leaf], p2[leaf], rtol=0, atol=(0.5 if flipped else 0.02) * moved)
    assert np.mean(np.abs(np.asarray(p1[leaf]) - np.asarray(p2[leaf])) > 1e-6 * moved) <= 1e-3, leaf


def test_apply_step_falls_back_and_rounds_bf16_stochastically():
  """Transformations without a fused step (optax.adamw, inject_hyperparams) take update +
  apply_updates; a chain ending in stochastic_rounding rounds bf16 weights in the fused step and
  advances the rounding key as its update does."""
  key = fresh_key()
  params = _params(key)
  grads = jax.tree.map(lambda p: jax.random.normal(key, p.shape), params)
  for tx in (optax.adamw(1e-3), optax.inject_hyperparams(optim.adamw_8bit)(learning_rate=1e-3)):
    assert getattr(tx, "fused_step", None) is None
    state = tx.init(params)
    new, _ = optim.apply_step(tx, grads, state, params)
    want = optax.apply_updates(params, tx.update(grads, state, params)[0])
    for leaf in params:
      np.testing.assert_array_equal(new[leaf], want[leaf])
  bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  tx = optim.make("adamw_8bit", 1e-3, stochastic_rounding_seed=0)
  assert tx.fused_step is not None
  state = tx.init(bf16)
  new, fused_state = jax.jit(lambda g, s, p: optim.apply_step(tx, g, s, p))(grads, state, bf16)
  _, unfused_state = tx.update(grads, state, bf16)
  np.testing.assert_array_equal(fused_state[1].key, unfused_state[1].key)
  assert all(new[leaf].dtype == jnp.bfloat16 for leaf in params)
  assert not np.array_equal(new["kernel"], bf16["kernel"])


def test_nesterov_and_mask():
  key = fresh_key()
  params = _params(key)
  mask = {"kernel": True, "heads": False, "norm": False, "odd": True}
  kw = dict(learning_rate=1e-3, weight_decay=0.5, mask=mask, nesterov=True)
  _, _, ours = _trajectory(optim.adamw_8bit(**kw), params, key, 4)
  _, _, ref = _trajectory(optax.adamw(**kw), params, key, 4)
  for u, r in zip(ours, ref):
    assert rel_err(u["kernel"], r["kernel"]) < UPDATE_RTOL["adamw_8bit"]
    np.testing.assert_array_equal(u["norm"], r["norm"])


@pytest.mark.parametrize("name", LOWBIT)
def test_heavy_tailed_sparse_gradients_stay_bounded(name):
  """A second moment rounded to zero would turn m / (sqrt(v) + eps) into m / 1e-8."""
  key = fresh_key()
  shape = (64, 1024)
  scale = 10.0 ** jax.random.uniform(jax.random.fold_in(key, 1), shape, minval=-4, maxval=0)  # 4 decades per block
  tx = optim.make(name, 1.0, weight_decay=0.0)
  params = {"w": jnp.zeros(shape)}
  state = tx.init(params)
  update = jax.jit(tx.update)
  for t in range(12):
    g = jax.random.normal(jax.random.fold_in(key, t), shape) * scale
    if t % 4 == 3:  # half the gradients exactly zero on some steps
      g = g * (jax.random.uniform(jax.random.fold_in(key, 100 + t), shape) < 0.5)
    u, state = update({"w": g}, state, params)
    # Exact Adam's |m_hat / sqrt(v_hat)| stays below ~7 (Cauchy-Schwarz with b1^2 < b2).
    assert float(jnp.max(jnp.abs(u["w"]))) < 10.0, t


@pytest.mark.parametrize("name", ["adamw_8bit", "adamw_4bit"])  # one-byte and packed half-byte codes
def test_fsdp_sharded_update_matches_unsharded(name):
  devices = np.array(jax.devices()[:8])
  assert devices.size == 8, "tests/conftest.py provides 8 CPU devices"
  mesh = Mesh(devices, ("fsdp",))
  key = fresh_key()
  params = {
      "kernel": jax.random.normal(key, (64, 1024)),  # 8 rows per shard
      "heads": jax.random.normal(jax.random.fold_in(key, 1), (16, 8, 64)),  # group (8, 64) per row
      "flat": jax.random.normal(jax.random.fold_in(key, 2), (8192,)),  # 1024 per shard = 4 blocks
      "norm": jnp.ones((64,)),
  }
  spec = {"kernel": P("fsdp", None), "heads": P("fsdp", None, None), "flat": P("fsdp"), "norm": P()}
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), spec)
  tx = optim.make(name, 1e-2, weight_decay=0.1)
  grads = _grad_sequence(key, params, 3)

  def run(params, grads):
    def step(carry, g):
      params, state = carry
      u, state = tx.update(g, state, params)
      return (optax.apply_updates(params, u), state), None

    return jax.lax.scan(step, (params, tx.init(params)), grads)[0]

  one = devices[0]
  p_ref, s_ref = jax.jit(run)(jax.device_put(params, one), jax.device_put(grads, one))
  stacked = jax.tree.map(lambda s: NamedSharding(mesh, P(None, *s)), spec)  # each step's gradients FSDP-sharded
  p_sh, s_sh = jax.jit(run, in_shardings=(shardings, stacked), out_shardings=(shardings, None))(params, grads)
  codes = s_sh[0].mu["kernel"]
  assert codes.sharding.spec[0] == "fsdp", f"the state follows the params' dim-0 sharding, got {codes.sharding}"
  assert len(codes.addressable_shards) == 8 and codes.addressable_shards[0].data.shape[0] == 8
  jax.tree.map(np.testing.assert_array_equal, p_sh, p_ref)
  jax.tree.map(np.testing.assert_array_equal, s_sh, s_ref)


STEPS = 300


def _mlp_problem(seed=0, d=64, h=256, c=16, steps=STEPS):
  """(params, loss(params, batch), batches): a 3-layer MLP learning a random teacher's labels.

  Every step sees a fresh batch (the online regime of LM pretraining); the batches are made
  once, outside the jitted steps, so no random generation is compiled into them.
  """

  def init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "w1": jax.random.normal(k1, (d, h)) / d**0.5, "b1": jnp.zeros(h),
        "w2": jax.random.normal(k2, (h, h)) / h**0.5, "b2": jnp.zeros(h),
        "w3": jax.random.normal(k3, (h, c)) / h**0.5,
    }  # fmt: skip

  def apply(p, x):
    x = jax.nn.gelu(x @ p["w1"] + p["b1"])
    return jax.nn.gelu(x @ p["w2"] + p["b2"]) @ p["w3"]

  inputs = jax.random.normal(jax.random.key(seed + 1), (steps, 128, d))
  labels = jnp.argmax(apply(init(jax.random.key(seed + 1000)), inputs), -1)

  def loss(p, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(apply(p, x), y).mean()

  return init(jax.random.key(seed)), loss, (inputs, labels)


def train(tx, params, loss, batches, apply_updates=optax.apply_updates):
  """(final loss = mean of the last 30 steps, first loss): one step per batch, one jitted scan."""

  @jax.jit
  def run(params, batches):
    def step(carry, batch):
      params, state = carry
      value, grads = jax.value_and_grad(loss)(params, batch)
      updates, state = tx.update(grads, state, params)
      return (apply_updates(params, updates), state), value

    _, losses = jax.lax.scan(step, (params, tx.init(params)), batches)
    return losses

  losses = run(params, batches)
  return float(jnp.mean(losses[-30:])), float(losses[0])


@functools.cache
def _reference_loss():
  params, loss, batches = _mlp_problem()
  return train(optax.adamw(3e-3, weight_decay=0.01), params, loss, batches)


@pytest.mark.parametrize("name", LOWBIT)
def test_300_steps_reach_adamw_loss_within_3_percent(name):
  params, loss, batches = _mlp_problem()
  ref, start = _reference_loss()
  ours, _ = train(optim.make(name, 3e-3, weight_decay=0.01), params, loss, batches)
  assert ref < 0.8 * start, "the reference must actually learn"
  assert ours <= 1.03 * ref, (ours, ref)


def test_errors_say_what_to_do():
  with pytest.raises(ValueError, match="block_size must be an even int"):
    optim.adamw_8bit(1e-3, block_size=255)
  with pytest.raises(ValueError, match="block_size must be an even int"):
    optim.adamw_4bit(1e-3, block_size=0)
  with pytest.raises(TypeError, match="v_dtype must be jnp.float8_e4m3fn or jnp.float16"):
    optim.adamw_fp8(1e-3, v_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="unknown optimizer 'adam8'.*adamw_8bit"):
    optim.make("adam8", 1e-3)
  with pytest.raises(ValueError, match="first moment is signed"):
    unsigned = qstate.BlockFormat("dynamic", signed=False)
    optim.scale_by_adam_quantized(unsigned, unsigned)
  with pytest.raises(ValueError, match="share one block size"):
    optim.scale_by_adam_quantized(qstate.BlockFormat("e4m3", block=128), qstate.BlockFormat("e4m3", block=256))
  with pytest.raises(TypeError, match="BlockFormat"):
    optim.scale_by_adam_quantized("dynamic", qstate.BlockFormat("e4m3"))
