"""The peer rows of the benchmarks (benchmarks/peers.py): Qwix int8/fp8 and Flax's FP8 op on our bf16 model.

Each peer must really quantize (its forward differs from bf16's, its projections' dots take 8-bit
operands forward and backward, attention and the LM head stay bf16) and train (finite loss). The Qwix
rows skip where qwix is not installed (CI does not install it).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import peers
from helpers import equations
from train import config as train_config
from train import data
from train.model import Transformer
from train.spec import resolve

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.py"
# The micro model of test_train_loop's benchmark test: fast to compile on CPU. Layers unrolled, as the
# 1B configs run them (Flax's FP8 scales cannot pass the layer scan).
MICRO = {"data.source": "synthetic", "mesh.fsdp": 1, "model.scan_layers": False, "model.d_model": 32,
         "model.n_layers": 2, "model.n_heads": 2, "model.n_kv_heads": 1, "model.d_ff": 64, "batch_size": 4,
         "seq_len": 32, "lr": 0.01, "warmup_steps": 2}
# Quantized operand dtypes per peer: forward (x, W) and backward (gradient, saved operand).
OPERANDS = {
    "qwix_int8": {("int8", "int8")},
    "qwix_fp8": {("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e4m3fn")},
    "flax_fp8": {("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e4m3fn")},
}
PROJECTIONS_PER_LAYER = 4  # qkv, out, gate_up, down (fused projections, the default)
DOTS_PER_PROJECTION = 3  # forward, grad_input, grad_weight


def _peer(name: str) -> str:
  if name.startswith("qwix"):
    pytest.importorskip("qwix")
  return name


def _micro_spec(seed: int = 0):
  return resolve(train_config.load_file(str(TINY), {**MICRO, "seed": seed}))


def _dot_operand_dtypes(jaxpr) -> collections.Counter:
  """Every dot_general in ``jaxpr`` (and the jaxprs inside its equations), counted by operand dtypes."""
  return collections.Counter(tuple(str(v.aval.dtype) for v in e.invars) for e in equations(jaxpr)
                             if e.primitive.name == "dot_general")


def test_quantized_projections_follow_the_recipe_switches():
  config = _micro_spec().model
  assert peers.quantized_projections(config) == ("layers.attn.qkv", "layers.attn.out", "layers.mlp.gate_up",
                                                 "layers.mlp.down")
  kept = dataclasses.replace(config, filter_fqns=("down",), quantize_attention=False)
  assert peers.quantized_projections(kept) == ("layers.mlp.gate_up",)


@pytest.mark.parametrize("name", peers.PEERS)
@pytest.mark.parametrize("seed", [0, 1])
def test_peer_quantizes_the_projections_and_keeps_the_parameters(name, seed):
  spec = _micro_spec(seed)
  base = Transformer(spec.model)
  model = peers.peer_model(_peer(name), base)
  tokens = jnp.asarray(np.random.default_rng(seed).integers(0, spec.model.vocab_size, (2, 32)), jnp.int32)
  params = base.init(jax.random.key(seed), tokens)["params"]
  variables = model.init(jax.random.key(seed), tokens)
  assert jax.tree.structure(variables["params"]) == jax.tree.structure(params)
  variables = {**variables, "params": params}

  ref = base.apply({"params": params}, tokens)
  out = model.apply(variables, tokens)
  rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
  # Measured 0.007 (int8), 0.015-0.024 (fp8): quantized (bf16 alone rounds the same way in both), not broken.
  assert 1e-3 < rel < 0.2, rel
  assert np.isfinite(np.asarray(out)).all()

  def loss(p):
    return jnp.sum(model.apply({**variables, "params": p}, tokens))

  counts = _dot_operand_dtypes(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
  quantized = sum(n for dtypes, n in counts.items() if dtypes in OPERANDS[name])
  assert quantized == spec.model.n_layers * PROJECTIONS_PER_LAYER * DOTS_PER_PROJECTION, counts
  # attention and the LM head stay in the compute dtype
  assert sum(n for dtypes, n in counts.items() if "8" in "".join(dtypes)) == quantized, counts


@pytest.mark.parametrize("accum", [1, 2])
def test_flax_fp8_step_carries_its_scales(accum):
  """The Qwix rows run the trainer's own step (test_throughput_benchmark_peer_rows); Flax FP8 threads its scales
  through the step (and its microbatches)."""
  spec = resolve(train_config.load_file(str(TINY), {**MICRO, "grad_accum_steps": accum}))
  functions = peers.step_functions(spec, "flax_fp8")
  stream = data.SyntheticBatches(spec.seq_len, spec.batch_size, spec.seed)
  state = functions.init()
  fp8_op = ("layers_0", "mlp", "down", "Fp8DirectDotGeneralOp_0", "input_scale")
  first_scale = float(_at(state.scales, fp8_op)[0])  # read now: the step donates the state
  losses = []
  for _ in range(3):
    state, metrics = functions.train_step(state, functions.shard_train_batch(stream.next()))
    losses.append(float(metrics["loss"]))
  assert np.isfinite(losses).all() and int(state.step) == 3
  # the delayed scales move on from their init (1) once amaxes are recorded
  assert first_scale == 1.0 and float(_at(state.scales, fp8_op)[0]) != 1.0


def _at(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def test_flax_fp8_refuses_the_layer_scan():
  spec = resolve(train_config.load_file(str(TINY), {**MICRO, "model.scan_layers": True}))
  with pytest.raises(ValueError, match="scan_layers=False"):
    peers.peer_model("flax_fp8", Transformer(spec.model))


def test_missing_qwix_is_a_note(monkeypatch):
  monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
  assert "not installed" in peers.missing("qwix_fp8")
  assert peers.missing("flax_fp8") is None
  with pytest.raises(ValueError, match="unknown peer"):
    peers.missing("aqt_int8")


@pytest.mark.parametrize("name", peers.PEERS)
def test_mlp_stack_peer(name):
  """benchmarks/layer.py's stack through the peer: same structure as its own step, quantized, finite."""
  from benchmarks import layer

  params, x, cot = layer.init(32, 64, 16, seed=3)
  out, (grads, dx) = peers.mlp_stack_step(_peer(name), params, x)(params, x, cot)
  ref_out, (ref_grads, ref_dx) = layer.make_step(None)(params, x, cot)
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads) and dx.shape == ref_dx.shape
  rel = float(jnp.linalg.norm((out - ref_out).astype(jnp.float32)) / jnp.linalg.norm(ref_out.astype(jnp.float32)))
  assert 1e-3 < rel < 0.2, rel
  assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in jax.tree.leaves((grads, dx)))


def test_throughput_benchmark_peer_rows(tmp_path, capsys):
  """train_throughput --peers on CPU: a row per peer after the bf16 row (Qwix rows: a note when it is missing)."""
  from benchmarks import train_throughput as throughput

  out = tmp_path / "throughput.json"
  sets = [arg for k, v in MICRO.items() if k not in ("data.source", "mesh.fsdp") for arg in ("--set", f"{k}={v}")]
  throughput.main(["--configs", str(TINY), "--peers", ",".join(peers.PEERS), "--steps", "2", "--warmup", "1",
                   "--out", str(out), *sets])
  printed = capsys.readouterr().out
  rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
  expected = ["tiny"] + [f"tiny+{name}" for name in peers.PEERS if peers.missing(name) is None]
  assert list(rows) == expected
  for name in peers.PEERS:
    if peers.missing(name) is None:
      row = rows[f"tiny+{name}"]
      assert row["recipe"] == name and np.isfinite(row["last_loss"]) and row["tokens_per_s"] > 0
    else:
      assert peers.missing(name) in printed
