"""Tensor parallelism (a ``tensor`` mesh axis, ``jaxlowbit.parallel.tensor``) on 8 virtual CPU devices.

- 5 trainer steps on a ``data x fsdp x tensor`` mesh give the per-step training losses and the
  validation loss of the run without tensor parallelism within ``test_train_fsdp``'s bounds:
  every recipe on (fsdp 4, tensor 2), bf16 and one recipe on (fsdp 2, tensor 4) and on
  (data 2, fsdp 2, tensor 2);
- a checkpoint of a tensor-parallel run resumes on another tensor size;
- the compiled step moves activations as the issue asks: before each column-parallel group one
  8-bit all-gather over the tensor axis (payload and scales in one message), the row-parallel
  outputs reduce-scattered in bf16; a negative control (bf16) shows the check tells them apart;
- ``mesh_shape`` and ``check`` refuse tensor sizes the model or batch cannot split, with messages
  that say what to change; ``python -m train.main --config.mesh.tensor=2`` runs.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import test_train_loop
from helpers import fresh_key
from test_train_fsdp import LOSS_RTOL, STEPS, TIE_FLIP_RTOL, assert_same_run, run_config, run_main, start_record
from test_train_loop import micro_config, train_losses
from jaxlowbit import fsdp
from jaxlowbit.parallel.hlo import collectives
from train import config as train_config
from train import loop, steps
from train.spec import resolve
from train.model import ModelConfig, Transformer, tensor_parallel_rules

corpus = test_train_loop.corpus  # its module-scoped fixture (generated text), here for this module

# The micro model with heads that split over tensor 2 and 4 (head_dim 4; 2 query heads per kv
# head, so every mesh runs grouped-query attention on its own heads) and separate q, k, v and
# gate, up kernels (fused ones cannot be split by heads).
TP_MODEL = {"model__n_heads": 8, "model__n_kv_heads": 4, "model__fused_projections": False}

# (recipe, (data, fsdp, tensor), the reference run's (data, fsdp)). The tensor axis splits each
# data x fsdp group's tokens, and its quantizers reduce their amaxes over it, so a group computes
# what one device holding the group's tokens computes. bf16 quantizes nothing over the tokens: its
# reference is the one-device run. INT8, FP8 and the shipped BitNet (int8 grad_weight) scale over a
# device's tokens (test_train_fsdp.SHARDED_VS_UNSHARDED says why): their reference is data parallelism
# over as many devices as there are groups, so what differs is exactly what tensor parallelism splits.
# INT8, FP8 rowwise and BitNet make grad_weight's x^T (and g's per-feature copy) from the gathered codes
# by default, one more rounding than the reference (bounds below).
# Every recipe on fsdp 4 x tensor 2; tensor 4 with BitNet's old placement and fused INT8; a data axis with bf16.
# (BitNet's every-projection form on tensor 2, bf16 on tensor 4 and INT8 beside a data axis ran too until
# 2026-11-26: each is the sum of two cases below, and the suite had to lose three minutes.)
TENSOR_VS_UNSHARDED = [
    ("bf16", (1, 4, 2), (1, 1)),
    ("int8", (1, 4, 2), (4, 1)),
    ("fp8_tensorwise", (1, 4, 2), (4, 1)),
    ("fp8_rowwise", (1, 4, 2), (4, 1)),
    ("bitnet", (1, 2, 4), (2, 1)),  # ternary weights split 4 ways along K: abs-means summed over shards
    ("bitnet+sub", (1, 4, 2), (4, 1)),  # sub-norms split over features; pre-norms quantize for the gathers
    ("bf16", (2, 2, 2), (1, 1)),
    ("int8+send", (1, 4, 2), (4, 1)),  # x^T sent beside the rows: the data-parallel run's numbers exactly
    ("bf16+fused", (1, 4, 2), (1, 1)),  # fused qkv / gate_up: each device [q_d | k_d | v_d], [gate_d | up_d]
    ("int8+fused", (1, 2, 4), (2, 1)),
]
# Under tensor parallelism the activations themselves are sums in another order (the row-parallel
# outputs are reduce-scattered), so an 8-bit or ternary code that sits on a rounding boundary can flip
# in one run and not in the other, as BitNet's weights can under FSDP (TIE_FLIP_RTOL). Measured: INT8
# with x^T requantized from the gathered codes 2.0e-6 to 4.3e-6 (seeds 1, 2, 5, 6), and FP8 tensorwise
# on (1, 4, 2) 1.05e-5 at step 4 in one CI run (one flip). Every low-bit recipe therefore gets the
# tie-flip bound from step 2 on; step 1 and the bf16 runs keep LOSS_RTOL (a wrong gather, scale or
# group split moves the loss by far more than 1e-3 from step 2).
# BitNet with sub-norms drifts further: each sub-norm's mean square is summed over the tensor devices, and every
# int8 code its projection reads rounds from it, so codes flip at every step, not on a rare tie (the step-1 grad
# norms differed by 2e-5 to 8e-4 on every seed). Measured over 25 seeds on (1, 4, 2) against (4, 1): training losses
# from step 2 up to 7.6e-4, validation up to 1.1e-3 (one CI run; the other 24 <= 3.7e-4). Its bound is 5e-3; step
# 1 keeps LOSS_RTOL.
SUB_NORM_TP_RTOL = 5e-3


@pytest.fixture(scope="module")
def seed() -> int:
  """One fresh ``config.seed`` (parameter init and data order) for the whole module."""
  return int(jax.random.randint(fresh_key(), (), 0, 2**31 - 1))


def tp_config(corpus: str, seed: int, recipe: str, data: int, fsdp_size: int, tensor: int):
  """``recipe``: a recipe name, ``"bitnet+sub"``: configs/bitnet_*.py's form (sub-norms, tied embeddings),
  or ``"<recipe>+send"``: the gathers send x^T (``config.fsdp.tensor_transposed``, default requantize),
  or ``"<recipe>+fused"``: the fused qkv and gate_up kernels (split by their groups)."""
  recipe, _, variant = recipe.partition("+")
  if variant == "send":
    form = {"fsdp__tensor_transposed": "send"}
  elif variant == "fused":
    form = {"model__fused_projections": True}
  else:
    form = {"model__bitnet_norm_placement": variant, "model__tie_embeddings": True} if variant else {}
  return run_config(corpus, seed, recipe, fsdp_size, data, mesh__tensor=tensor, **{**TP_MODEL, **form})


@pytest.fixture(scope="module")
def run(corpus, seed, tmp_path_factory):
  """``run(recipe, data, fsdp, tensor) -> run dir`` of a completed 5-step run (each runs once)."""
  root = tmp_path_factory.mktemp("runs")
  done = {}

  def run_once(recipe: str, data: int, fsdp_size: int, tensor: int = 1):
    key = (recipe, data, fsdp_size, tensor)
    if key not in done:
      run_dir = root / "_".join(map(str, key))
      result = loop.train(tp_config(corpus, seed, *key), run_dir)
      assert result.status == "completed" and result.step == STEPS
      done[key] = run_dir
    return done[key]

  return run_once


@pytest.mark.parametrize("recipe, mesh, reference_mesh", TENSOR_VS_UNSHARDED, ids=lambda v: str(v))
def test_tensor_parallel_run_equals_unsharded_run(recipe, mesh, reference_mesh, run, corpus, seed):
  """Per-step training losses and the final validation loss as in test_train_fsdp; the run really split."""
  run_dir = run(recipe, *mesh)
  if recipe.partition("+")[0] == "bf16":
    rtol = LOSS_RTOL
  else:
    rtol = SUB_NORM_TP_RTOL if recipe == "bitnet+sub" else TIE_FLIP_RTOL
  assert_same_run(run_dir, run(recipe, *reference_mesh), rtol=rtol)

  data, fsdp_size, tensor = mesh
  assert start_record(run_dir)["mesh"] == {"data": data, "fsdp": fsdp_size, "tensor": tensor}
  plan = steps.step_functions(resolve(tp_config(corpus, seed, recipe, *mesh))).runtime.plan  # cached by the run
  assert plan.tensor_size == tensor
  # The scanned stack's kernels [layers, K, N]: q's K over fsdp and its heads over tensor; down's
  # K over both, tensor-major (each tensor device's hidden units, FSDP-sharded within them).
  q = plan.spec(("layers", "attn", "qkv" if recipe.endswith("+fused") else "q", "kernel"))
  down = plan.spec(("layers", "mlp", "down", "kernel"))
  assert q == P(None, "fsdp", "tensor") and down == P(None, ("tensor", "fsdp")), (q, down)


@pytest.mark.parametrize("recipe", ["bf16", "bf16+fused"])
def test_tensor_parallel_checkpoint_resumes_on_another_mesh(recipe, run, corpus, seed, tmp_path, capsys):
  """A bf16 run on (fsdp 4, tensor 2) stopped at step 3 resumes on (fsdp 2, tensor 4) and continues the
  uninterrupted run: the checkpoint holds whole parameters whatever the mesh, fused kernels included
  (the compiled steps are those of the equality runs above)."""
  uninterrupted = run(recipe, 1, 4, 2)
  run_dir = tmp_path / "stopped"
  result = loop.train(tp_config(corpus, seed, recipe, 1, 4, 2), run_dir, should_stop=lambda step: step == 3)
  assert result.status == "interrupted" and result.checkpoint_step == 3
  capsys.readouterr()
  config = tp_config(corpus, seed, recipe, 1, 2, 4)
  config.resume = True
  result = loop.train(config, run_dir)
  assert result.status == "completed" and result.step == STEPS
  out = capsys.readouterr().out
  assert "mesh.tensor 2 -> 4" in out and "expect a different run" not in out, out
  assert start_record(run_dir)["step"] == 3 and start_record(run_dir)["mesh"] == {"data": 1, "fsdp": 2, "tensor": 4}
  assert_same_run(run_dir, uninterrupted)


# ---------------------------------------------------------------------------------------------
# What moves: the compiled gradient step of a one-layer bf16 model on (fsdp 4, tensor 2).

HLO_FSDP, HLO_TENSOR = 4, 2
HLO_BATCH, HLO_SEQ, HLO_D = 8, 32, 64
# Each device's token rows of its group: 8 sequences over 4 FSDP groups, their tokens over 2.
HLO_ROWS = HLO_BATCH // HLO_FSDP * HLO_SEQ // HLO_TENSOR  # 32
# The message of one gathered activation [32, 64] (jaxlowbit.parallel.tensor's table): INT8 sends
# its per-token rows and scales (x^T requantized from them after the gather), or with x^T (per
# input feature) as well under "send"; FP8 tensorwise sends its e4m3 rows (the one scale is reduced
# first, x^T derived from the rows).
ACTIVATION_BYTES = {
    "int8": HLO_ROWS * HLO_D + 4 * HLO_ROWS,
    "int8+send": HLO_ROWS * HLO_D + 4 * HLO_ROWS + HLO_D * HLO_ROWS,
    "fp8_tensorwise": HLO_ROWS * HLO_D,
}
# The issue's bound on the 8-bit tensor-axis bytes against bf16's (1 byte per element and its scales).
LOW_BIT_GATHER_RATIO = 0.55


def _tensor_parallel_step(recipe: str):
  """``(compiled HLO text, lowered StableHLO text)`` of value_and_grad of a 1-layer bf16 model's loss
  (``"<recipe>+send"``: x^T sent beside the rows; ``"<recipe>+fused"``: fused qkv and gate_up kernels)."""
  recipe, _, variant = recipe.partition("+")
  config = ModelConfig(d_model=HLO_D, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=2 * HLO_D, vocab_size=256,
                       dtype=jnp.bfloat16, recipe=train_config.recipe_from_name(recipe),
                       fused_projections=variant == "fused", scan_layers=False)
  model = Transformer(config)
  tokens = jax.random.randint(jax.random.key(1), (HLO_BATCH, HLO_SEQ + 1), 0, config.vocab_size)
  params = jax.eval_shape(model.init, jax.random.key(0), tokens[:1, :-1])["params"]
  mesh = fsdp.make_mesh(fsdp=HLO_FSDP, tensor=HLO_TENSOR)
  plan = fsdp.plan_for_model(model, params, tokens[:1, :-1], mesh=mesh, tensor_parallel=tensor_parallel_rules(config),
                             config=fsdp.FsdpConfig(tensor_transposed="send" if variant == "send" else "requantize"))

  def loss_fn(p, scales, batch):
    logits = fsdp.apply(model, p, batch[:, :-1], plan=plan, scales=scales)
    targets = plan.tensor_parallel.local_tokens(batch[:, 1:])
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  sharded = fsdp.shard_params(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params), plan)
  scales = jax.jit(lambda p: fsdp.precompute_scales(p, plan))(sharded)
  lowered = jax.jit(fsdp.value_and_grad(loss_fn, plan)).lower(sharded, scales, fsdp.shard_batch(tokens, plan))
  return lowered.compile().as_text(), lowered.as_text()


# A reduce-scatter in the lowered program: its replica groups and its result type.
_LOWERED_SCATTER = re.compile(
    r'"stablehlo\.reduce_scatter".*?replica_groups = dense<\[\[(?P<group>[\d, ]*)\].*?'
    r"\}\) : \(tensor<[^>]*>\) -> tensor<(?P<type>[^>]*)>", re.DOTALL)


def _tensor_scatter_types(lowered: str) -> list[str]:
  """Result types (``32x64xbf16``) of the lowered program's reduce-scatters over the tensor axis."""
  return [m["type"] for m in _LOWERED_SCATTER.finditer(lowered) if len(m["group"].split(",")) == HLO_TENSOR]


# An all-gather in the lowered program: its replica groups, operand and result types.
_LOWERED_GATHER = re.compile(
    r'"stablehlo\.all_gather".*?replica_groups = dense<\[\[(?P<group>[\d, ]*)\].*?'
    r"\}> : \(tensor<(?P<source>[^>]*)>\) -> tensor<[^>]*>", re.DOTALL)


@pytest.mark.parametrize("recipe, dtype", [("bf16+fused", "bf16"), ("int8+fused", "f32")])
def test_fused_kernels_cross_the_tensor_axis_in_the_dtype_their_linear_reads(recipe, dtype):
  """A fused qkv / gate_up kernel's stored ``[K / fsdp, N / tensor]`` block is all-gathered over the tensor axis
  (ColumnParallel.regroup) in bf16 for a high-precision model, which casts it to bf16 anyway (half of float32's
  bytes), and in float32 for INT8, whose quantizer reads the master weight (the runs' equality with the unsharded
  run is test_tensor_parallel_run_equals_unsharded_run's bf16+fused and int8+fused rows)."""
  blocks = {f"{HLO_D // HLO_FSDP}x{width // HLO_TENSOR}" for width in (2 * HLO_D, 2 * 2 * HLO_D)}  # qkv, gate_up
  lowered = _tensor_parallel_step(recipe)[1]
  sources = [m["source"] for m in _LOWERED_GATHER.finditer(lowered) if len(m["group"].split(",")) == HLO_TENSOR]
  kernels = [s for s in sources if s.rsplit("x", 1)[0] in blocks]
  assert sorted(kernels) == sorted(f"{block}x{dtype}" for block in blocks), sources


@functools.cache
def _tensor_gathers(recipe: str) -> list:
  """The compiled step's all-gathers over the tensor axis (each recipe compiles once)."""
  found = collectives(_tensor_parallel_step(recipe)[0])
  return [c for c in found if c.op == "all-gather" and c.group_size == HLO_TENSOR]


@pytest.mark.parametrize("recipe", ["int8", "fp8_rowwise", "fp8_tensorwise"])
def test_8_bit_tensor_gathers_move_half_of_bf16s_bytes(recipe):
  """Each activation (and row-parallel g) crosses the tensor axis once, 1 byte per element plus scales:
  at most 0.55x the bf16 step's gathered bytes (counted at 2 bytes per element: XLA:CPU gathers them
  in float32 where a GPU keeps bf16). Negative control: INT8 sending x^T too moves as many as bf16."""
  bf16_bytes = 2 * sum(math.prod(shape) for c in _tensor_gathers("bf16") for _, shape in c.results)
  low_bit = _tensor_gathers(recipe)
  assert all(c.dtype == "u8" for c in low_bit), low_bit
  ratio = sum(c.bytes for c in low_bit) / bf16_bytes
  print(f"{recipe}: tensor-axis all-gather bytes {ratio:.3f}x bf16's ({bf16_bytes} bytes)")
  assert ratio <= LOW_BIT_GATHER_RATIO, (ratio, low_bit)
  if recipe == "int8":
    sent = sum(c.bytes for c in _tensor_gathers("int8+send")) / bf16_bytes
    assert sent > 1, sent


@pytest.mark.parametrize("recipe", ["int8", "int8+send", "fp8_tensorwise", "bf16"])
def test_activations_gather_8_bit_and_outputs_reduce_scatter_bf16(recipe):
  compiled, lowered = _tensor_parallel_step(recipe)
  found = collectives(compiled)
  assert {c.group_size for c in found} >= {HLO_FSDP, HLO_TENSOR}, found
  gathers = [c for c in found if c.op == "all-gather" and c.group_size == HLO_TENSOR]
  if recipe == "bf16":
    # Negative control: the same count finds the gathers (2 forward, 2 of g), in the compute
    # dtype (XLA:CPU hoists its float32 dot's convert above them), none of them 8-bit.
    assert len(gathers) == 4 and all(c.dtype in ("bf16", "f32") for c in gathers), found
    assert all(c.shape == (HLO_ROWS * HLO_TENSOR, HLO_D) for c in gathers), found
  else:
    # One per column-parallel group in the forward (q, k, v; gate, up) and, where the recipe
    # quantizes the output gradient anyway, one per row-parallel linear's g (out, down): its
    # [32, 64] rows travel as the activations do, so all four messages have the same bytes.
    assert len(gathers) == 4, found
    assert all(c.dtype == "u8" and c.shape == (HLO_TENSOR, ACTIVATION_BYTES[recipe]) for c in gathers), found
  # Row-parallel outputs (forward: out, down) and the gathers' dx (backward) leave in bf16:
  # 4 reduce-scatters over tensor, bf16 as JAX hands them to XLA (XLA:CPU then runs them in
  # float32, as it runs the dots before them; a GPU keeps bf16).
  assert _tensor_scatter_types(lowered) == [f"{HLO_ROWS}x{HLO_D}xbf16"] * 4, lowered.count("reduce_scatter")
  scatters = [c for c in found if c.op == "reduce-scatter" and c.group_size == HLO_TENSOR]
  assert len(scatters) == 4 and all(c.shape == (HLO_ROWS, HLO_D) for c in scatters), found


# ---------------------------------------------------------------------------------------------
# Configuration: what the trainer refuses, and the command line.


def test_mesh_shape_with_tensor_resolves_and_rejects(corpus):
  def shape(devices: int = 8, **overrides):
    config = micro_config(corpus, **{**TP_MODEL, "batch_size": 16, **overrides})
    return resolve(config, device_count=devices, process_count=1).mesh

  auto = {"mesh__fsdp": train_config.MESH_AUTO}
  assert shape(mesh__tensor=2, **auto) == (1, 4, 2)
  assert shape(mesh__tensor=4, mesh__data=2, **auto) == (2, 1, 4)
  assert shape(mesh__tensor=8, model__n_kv_heads=8, **auto) == (1, 1, 8)
  assert shape(mesh__tensor=2, mesh__fsdp=2) == (1, 2, 2)  # one process may leave devices idle

  with pytest.raises(ValueError, match=r"config.mesh.tensor must be an integer in \[1, inf\), got 0"):
    shape(mesh__tensor=0)
  with pytest.raises(ValueError, match="mesh.data=3 x tensor=2 does not divide the 8 visible devices"):
    shape(mesh__tensor=2, mesh__data=3, **auto)
  with pytest.raises(ValueError, match="tensor=3 does not divide config.model.n_heads=8"):
    shape(mesh__tensor=3, **auto)
  with pytest.raises(ValueError, match="data=1 x fsdp=4 x tensor=4 needs 16 devices but 8 are visible"):
    shape(mesh__tensor=4, mesh__fsdp=4)
  assert shape(mesh__tensor=2, model__fused_projections=True, **auto) == (1, 4, 2)  # split by groups
  with pytest.raises(ValueError, match=r"tensor=8 does not divide config.model.n_kv_heads=4.*divides n_heads"):
    shape(mesh__tensor=8, model__n_heads=16, **auto)
  with pytest.raises(ValueError, match=r"tensor=4 does not divide config.model.d_ff=66"):
    shape(mesh__tensor=4, model__d_ff=66, **auto)
  # 16 sequences of 3 tokens over 8 groups: 6 tokens per group do not split over tensor 4.
  with pytest.raises(ValueError, match=r"6 tokens.*do not split over its 4 tensor-parallel devices.*multiple"):
    shape(devices=32, mesh__tensor=4, seq_len=3, **auto)


def test_main_runs_tensor_parallel(tmp_path, corpus):
  """``python -m train.main --config.mesh.tensor=2`` on 8 devices with the default (fused) projections:
  (fsdp 4, tensor 2), exit 0, the loss falls."""
  fields = {"model.d_model": 32, "model.n_layers": 1, "model.n_heads": 4, "model.n_kv_heads": 2, "model.d_ff": 64,
            "model.dtype": "float32", "mesh.tensor": 2, "recipe": "int8",
            "data.path": corpus, "steps": 2, "batch_size": 8, "seq_len": 32, "warmup_steps": 1, "log_every": 1,
            "eval_every": 2, "eval_batches": 1, "checkpoint_every": 2, "tensorboard": False}
  run_dir = tmp_path / "main"
  proc = run_main(run_dir, fields, devices=8)
  assert "mesh data 1 x fsdp 4 x tensor 2" in proc.stdout and "linears tensor-parallel" in proc.stdout, proc.stdout
  assert start_record(run_dir)["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2}
  losses = train_losses(run_dir)
  assert sorted(losses) == [1, 2] and np.isfinite(list(losses.values())).all()
