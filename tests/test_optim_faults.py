"""Low-bit AdamW under hostile inputs: gradients that overflow ``g * g``, another optimizer's state,
a state restored without a target, a bad rounding seed."""

import pickle

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from helpers import fresh_key
from jaxlowbit import optim
from jaxlowbit_numerics.adam import MOMENT_MAX

LOW_BIT = ["adamw_8bit", "adamw_4bit", "adamw_fp8", "adamw_fp8_o2"]
# Finite gradients whose square overflows float32 (1e20 and up), up to float32's max.
HUGE = [1e20, 1e25, 1e30, 3e38]
SHAPE = (16, 512)  # 2 to 4 blocks per row: the outlier's block and its neighbours
OUTLIER = (3, 5)
B1, B2, EPS, LR = 0.9, 0.999, 1e-8, 1e-3


def _adam64(grads):
  """float64 Adam updates of one element over ``grads`` (no overflow at these magnitudes)."""
  m = v = 0.0
  out = []
  for t, g in enumerate(grads, 1):
    m, v = B1 * m + (1 - B1) * g, B2 * v + (1 - B2) * g * g
    out.append((m / (1 - B1**t)) / (np.sqrt(v / (1 - B2**t)) + EPS))
  return out


@pytest.mark.parametrize("big", HUGE)
@pytest.mark.parametrize("name", LOW_BIT)
def test_huge_gradient_keeps_the_state_finite(name, big):
  """One gradient element of ``big`` (``g * g`` overflows; optax's ``v`` holds inf there and its
  update is 0): the low-bit state stays finite everywhere, the step's update equals optax's, and
  the outlier's later updates are float64 Adam's (its pair was scaled down, ratio kept), where
  optax's overflowed state says 0. Every parameter optax keeps finite stays finite."""
  key = fresh_key()
  tx, ref = optim.make(name, LR, weight_decay=0.0), optax.adamw(LR, B1, B2, EPS, weight_decay=0.0)
  params = {"w": jax.random.normal(key, SHAPE) * 0.02}
  grads = [jax.random.normal(jax.random.fold_in(key, t), SHAPE) * 1e-2 for t in range(1, 5)]
  grads[0] = grads[0].at[OUTLIER].set(big)
  state, ref_state, p, p_ref = tx.init(params), ref.init(params), params, params
  step, ref_step = jax.jit(tx.update), jax.jit(ref.update)
  for t, g in enumerate(grads):
    u, state = step({"w": g}, state, p)
    u_ref, ref_state = ref_step({"w": g}, ref_state, p_ref)
    p, p_ref = optax.apply_updates(p, u), optax.apply_updates(p_ref, u_ref)
    for leaf in jax.tree.leaves(state):
      assert np.all(np.isfinite(np.asarray(leaf, np.float32))), f"step {t}: a non-finite state leaf"
    assert np.all(np.isfinite(np.asarray(p["w"]))) and np.all(np.isfinite(np.asarray(u["w"]))), f"step {t}"
    assert np.all(np.isfinite(np.asarray(p_ref["w"]))), "optax stays finite here too"
    if t == 0:  # fresh (zero) moments: the same float32 arithmetic as optax, overflow included
      np.testing.assert_allclose(u["w"], u_ref["w"], rtol=1e-6, atol=0)
    else:  # the outlier's pair sits at its block's max: stored exactly, so Adam's ratio survives
      want = _adam64([float(gr[OUTLIER]) for gr in grads[: t + 1]])[-1] * -LR
      np.testing.assert_allclose(float(u["w"][OUTLIER]), want, rtol=1e-3, err_msg=f"step {t}")


@pytest.mark.parametrize("name", LOW_BIT)
def test_nonfinite_gradients_still_turn_their_block_nan(name):
  """The overflow guard is for finite gradients: an inf gradient keeps the NaN-block contract."""
  tx = optim.make(name, LR)
  params = {"w": jnp.zeros(SHAPE)}
  g = jnp.zeros(SHAPE).at[OUTLIER].set(jnp.inf)
  _, state = jax.jit(tx.update)({"w": g}, tx.init(params), params)
  adam = state[0]
  assert np.isnan(np.asarray(adam.nu_scale["w"])[OUTLIER[0], 0]) and np.isnan(adam.mu_scale["w"][OUTLIER[0], 0])
  assert np.isfinite(np.asarray(adam.nu_scale["w"])[OUTLIER[0], 1:]).all()


def test_moment_max_leaves_decoding_headroom():
  assert MOMENT_MAX * 2 < np.finfo(np.float32).max


@pytest.mark.parametrize("given", ["adamw_8bit", "adamw_fp8", "adamw_fp8_o2", "adamw"])
@pytest.mark.parametrize("name", LOW_BIT)
def test_another_optimizers_state_is_refused_naming_both(name, given):
  if given == name:
    pytest.skip("its own state")
  params = {"w": jnp.zeros((8, 1024))}
  foreign = optim.make(given, LR).init(params)
  named = "optax.adamw" if given == "adamw" else given
  tx = optim.make(name, LR)
  with pytest.raises(TypeError, match=rf"{name}\.update: got the state of {named}\b.*not a state of {name}"):
    jax.jit(tx.update)(params, foreign, params)
  with pytest.raises(TypeError, match=rf"got the state of {named}\b"):  # the fused step checks the same
    jax.jit(lambda g, s, p: optim.apply_step(tx, g, s, p))(params, foreign, params)


@pytest.mark.parametrize("given", LOW_BIT)
def test_the_registrys_adamw_refuses_a_low_bit_state(given):
  """optax.adamw's own update would read the codes as moments; the registry's adamw (the trainer's) says no."""
  params = {"w": jnp.zeros((8, 1024))}
  tx = optim.make("adamw", LR)
  u, _ = jax.jit(tx.update)(params, tx.init(params), params)  # its own state: optax.adamw's arithmetic
  np.testing.assert_array_equal(u["w"], optax.adamw(LR).update(params, optax.adamw(LR).init(params), params)[0]["w"])
  with pytest.raises(TypeError, match=rf"adamw\.update: got the state of {given}, not a state of optax.adamw"):
    jax.jit(tx.update)(params, optim.make(given, LR).init(params), params)
  chained = optim.chain(optax.clip_by_global_norm(1.0), optim.make("adamw", LR))
  foreign = optim.chain(optax.clip_by_global_norm(1.0), optim.make(given, LR)).init(params)
  with pytest.raises(TypeError, match=rf"got the state of {given}"):
    optim.apply_step(chained, params, foreign, params)


@pytest.mark.parametrize("given", LOW_BIT)
def test_plain_optax_adamw_refuses_a_low_bit_state_whose_layout_is_unchanged(given):
  """optax.adamw's own update read adamw_8bit's int8 codes as moments and returned garbage (issue 31); it now
  stops at optax's first read of the codes, naming the format. The fields (the checkpoint's layout) are as before,
  and every other reader still gets them."""
  params = {"w": jnp.ones((8, 1024))}
  state = optim.make(given, LR).init(params)
  for tx, given_state in ((optax.adamw(LR), state), (optax.scale_by_adam(), state[0])):
    with pytest.raises(TypeError, match=rf"optax\._src\.\w+: got the state of {given}, whose mu holds block-quantized"):
      tx.update(params, given_state, params)
    with pytest.raises(TypeError, match=rf"got the state of {given}"):
      jax.jit(tx.update)(params, given_state, params)
  paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  assert paths == ["[0].count", "[0].mu['w']", "[0].nu['w']", "[0].mu_scale['w']", "[0].nu_scale['w']"]
  assert state[0].mu["w"] is state[0][1]["w"] and state[0].nu["w"] is state[0][2]["w"]
  assert state[0]._asdict()["mu"]["w"] is state[0][1]["w"]


def test_a_state_carries_its_format_through_tree_maps_pickle_and_a_targeted_restore(tmp_path):
  tx = optim.adamw_4bit(LR)
  params = {"w": jnp.zeros((8, 1024))}
  state = tx.init(params)
  assert state[0].format_name == "adamw_4bit" and state[0].m_format == optim.moment_formats("adamw_4bit")[0]
  assert isinstance(state[0], optim.ScaleByAdamQuantizedState)
  assert type(jax.tree.map(lambda x: x, state)[0]) is type(state[0])
  assert type(pickle.loads(pickle.dumps(state))[0]) is type(state[0])
  assert type(jax.eval_shape(tx.init, params)[0]) is type(state[0])
  assert optim.adamw_8bit(LR, block_size=128).init(params)[0].format_name == "adamw_8bit(block_size=128)"
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "c", state)
  checkpointer.wait_until_finished()
  restored = checkpointer.restore(tmp_path / "c", jax.eval_shape(tx.init, params))
  tx.update(params, restored, params)  # the target's types come back: accepted
  untargeted = checkpointer.restore(tmp_path / "c")
  with pytest.raises(TypeError, match="restored without a target.*eval_shape"):
    tx.update(params, untargeted, params)


@pytest.mark.parametrize("seed", ["x", 1.5, True, None.__class__])
def test_a_bad_rounding_seed_is_one_clear_error(seed):
  with pytest.raises(TypeError, match="stochastic_rounding: seed must be an int or a typed jax.random.key"):
    optim.make("adamw_8bit", LR, stochastic_rounding_seed=seed)
