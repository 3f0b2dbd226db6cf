"""FSDP with low-bit weight gathers: bytes moved and step time per recipe, and INT8 weight-scaling accuracy.

Run from the repository root (no network needed)::

    PYTHONPATH=. python benchmarks/fsdp.py --out fsdp.json                 # all devices on the FSDP axis
    PYTHONPATH=. python benchmarks/fsdp.py --layers 4 --variants bf16,int8-row --out quick.json

speed: a ~1B-parameter stack of transformer-shaped linears (per block: four D x D
projections and a SwiGLU MLP D -> H -> D, RMSNorms between; no attention mixing; blocks
under ``nn.scan``), fp32 master weights, bf16 compute, AdamW, FSDP over every device
(``--data`` for HSDP). For each
variant it compiles one ``jaxlowbit.fsdp.train_step`` and reports, from the compiled
program, every collective's executions and bytes per step (loop trip counts included;
all-gather: what each device receives), the gather element types, and the median step
time over ``--steps`` steps.

accuracy: SQNR (dB, against float64) of output, grad_input and grad_weight of one INT8
linear with ``int8_weight_scaling="tensor"`` vs ``"row"`` (and unsharded
``quantized_matmul``), for Gaussian weights and for weights whose output channels span 100x
in magnitude (as trained weights' channels do).

Prints a table per section and writes everything as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxlowbit  # noqa: E402
from benchmarks.common import table, write_json  # noqa: E402
from benchmarks.layer import sqnr  # noqa: E402
from jaxlowbit import BitNet, Float8, Int8MixedPrecision, fsdp  # noqa: E402
from jaxlowbit.parallel.hlo import collectives, summarize  # noqa: E402

# name -> (recipe, FsdpConfig fields)
VARIANTS = {
    "bf16": (None, {}),
    "int8-tensor": (Int8MixedPrecision(), {"int8_weight_scaling": "tensor"}),
    "int8-row": (Int8MixedPrecision(), {"int8_weight_scaling": "row"}),
    "int8-row-regather": (Int8MixedPrecision(), {"int8_weight_scaling": "row", "remat": "regather"}),
    "fp8-tensorwise": (Float8("tensorwise"), {}),
    "fp8-rowwise": (Float8("rowwise"), {}),
    "bitnet": (BitNet.presets["bitnet"], {}),  # the trainer's "bitnet"; before 2026-11-27 this row ran BitNet()
    "bitnet_hp_bwd": (BitNet.presets["bitnet_hp_bwd"], {}),
}
# Llama-1B-like widths: 16 blocks x (4 x 2048^2 + 3 x 2048 x 8192) = 1.07e9 parameters.
DEFAULT_LAYERS, DEFAULT_DIM, DEFAULT_HIDDEN = 16, 2048, 8192


class Block(nn.Module):
  recipe: object
  dim: int
  hidden: int

  @nn.compact
  def __call__(self, x, _):
    dense = functools.partial(jaxlowbit.dense_for, self.recipe, use_bias=False, dtype=jnp.bfloat16)
    h = nn.RMSNorm(dtype=jnp.bfloat16)(x)
    q, k, v = (dense(features=self.dim, name=n)(h) for n in ("q", "k", "v"))
    x = x + dense(features=self.dim, name="o")(q * jax.nn.sigmoid(k) + v)  # stand-in for attention
    h = nn.RMSNorm(dtype=jnp.bfloat16)(x)
    gate, up = dense(features=self.hidden, name="gate")(h), dense(features=self.hidden, name="up")(h)
    return x + dense(features=self.dim, name="down")(nn.silu(gate) * up), None


class Stack(nn.Module):
  """``layers`` Blocks under ``nn.scan`` (kernels ``[layers, K, N]``, sharded along K), as train/ does."""

  recipe: object
  layers: int
  dim: int
  hidden: int

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers)
    return stack(self.recipe, self.dim, self.hidden, name="blocks")(x, None)[0]


def run_speed(args, mesh) -> list[dict]:
  tokens_per_device = args.batch * args.seq
  batch_size = args.batch * mesh.size
  x_shape = (batch_size, args.seq, args.dim)
  rows = []
  for name in args.variants:
    recipe, config_fields = VARIANTS[name]
    config = fsdp.FsdpConfig(**config_fields)
    model = Stack(recipe, args.layers, args.dim, args.hidden)
    init_model = Stack(None, args.layers, args.dim, args.hidden)  # same tree; init without low-bit matmuls
    example = jax.ShapeDtypeStruct(x_shape, jnp.bfloat16)
    abstract = jax.eval_shape(lambda k, x: init_model.init(k, x)["params"], jax.random.key(0), example)
    plan = fsdp.plan_for_model(model, abstract, example, mesh=mesh, config=config)
    params = jax.jit(lambda k: init_model.init(k, jnp.zeros(x_shape, jnp.bfloat16))["params"],
                     out_shardings=plan.shardings())(jax.random.key(0))
    optimizer = optax.adamw(1e-4)
    opt_state = fsdp.init_optimizer(optimizer, params, plan)
    scales = jax.jit(lambda p: fsdp.precompute_scales(p, plan))(params)

    def loss_fn(params, scales, x):
      y = fsdp.apply(model, params, x, plan=plan, scales=scales)
      return jnp.mean(jnp.square(y.astype(jnp.float32)))

    step = fsdp.train_step(loss_fn, optimizer, plan)
    x = jax.jit(lambda k: jax.random.normal(k, x_shape, jnp.bfloat16),
                out_shardings=jax.sharding.NamedSharding(mesh, plan.batch_spec()))(jax.random.key(1))
    t0 = time.perf_counter()
    compiled = step.lower(params, opt_state, scales, x).compile()
    compile_s = time.perf_counter() - t0
    summary = summarize(collectives(compiled.as_text()))
    times = []
    for i in range(args.warmup + args.steps):
      t0 = time.perf_counter()
      params, opt_state, scales, loss = compiled(params, opt_state, scales, x)
      jax.block_until_ready(loss)
      if i >= args.warmup:
        times.append(time.perf_counter() - t0)
    step_ms = 1e3 * float(np.median(times))
    memory = jax.devices()[0].memory_stats() or {}
    n_params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params))
    row = {
        "variant": name,
        "recipe": str(recipe),
        "config": dataclasses.asdict(config),
        "params": n_params,
        "linears": len(plan.linears),
        "compile_s": round(compile_s, 1),
        "step_ms": round(step_ms, 2),
        "step_ms_all": [round(1e3 * t, 2) for t in times],
        "tokens_per_s_per_device": round(tokens_per_device / (step_ms / 1e3), 1),
        "final_loss": float(loss),
        "collectives": summary,
        "peak_bytes_in_use": memory.get("peak_bytes_in_use"),
    }
    rows.append(row)
    print(f"  {name}: {step_ms:.1f} ms/step, compile {compile_s:.0f} s, "
          f"all-gather {summary.get('all-gather', {}).get('bytes', 0) / 2**20:.1f} MiB", flush=True)
    del params, opt_state, scales, compiled
  return rows


def run_accuracy(args) -> list[dict]:
  m, k, n = args.acc_shape
  kx, kw, kg, ks = jax.random.split(jax.random.key(args.seed), 4)
  x = jax.random.normal(kx, (m, k), jnp.float32)
  g = jax.random.normal(kg, (m, n), jnp.float32)
  gaussian = jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)
  cases = {
      "int8 tensor (a)": lambda x, w: fsdp.fsdp_linear(
          x, w, Int8MixedPrecision(), config=fsdp.FsdpConfig(int8_weight_scaling="tensor")),
      "int8 row (b)": lambda x, w: fsdp.fsdp_linear(
          x, w, Int8MixedPrecision(), config=fsdp.FsdpConfig(int8_weight_scaling="row")),
      "quantized_matmul": lambda x, w: jaxlowbit.quantized_matmul(x, w, Int8MixedPrecision()),
  }
  rows = []
  for spread in (1.0, 100.0):  # output channels' magnitudes spanning this factor (log-uniform)
    half = np.log(spread) / 2
    w = gaussian * jnp.exp(jax.random.uniform(ks, (1, n), minval=-half, maxval=half))
    x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
    exact = {"output": x64 @ w64, "grad_input": g64 @ w64.T, "grad_weight": x64.T @ g64}
    for name, f in cases.items():
      outs = jax.jit(lambda x, w, g, f=f: (lambda y_vjp: (y_vjp[0], *y_vjp[1](g)))(jax.vjp(f, x, w)))(x, w, g)
      db = {key: round(sqnr(o, exact[key]), 2) for key, o in zip(exact, outs)}
      rows.append({"channel_spread": f"{spread:g}x", "case": name, **db})
  return rows


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="path of the JSON results")
  parser.add_argument("--sections", default="accuracy,speed")
  parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
  parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS)
  parser.add_argument("--dim", type=int, default=DEFAULT_DIM)
  parser.add_argument("--hidden", type=int, default=DEFAULT_HIDDEN)
  parser.add_argument("--batch", type=int, default=4, help="sequences per device")
  parser.add_argument("--seq", type=int, default=2048)
  parser.add_argument("--data", type=int, default=1, help="size of the data (replica) axis; the rest is FSDP")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--acc-shape", type=lambda s: tuple(int(v) for v in s.split(",")), default=(4096, 2048, 2048),
                      help="M,K,N of the accuracy linear")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  args.variants = [v for v in args.variants.split(",") if v]
  unknown = [v for v in args.variants if v not in VARIANTS]
  if unknown:
    parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
  sections = set(args.sections.split(","))

  result = {"args": {k: v for k, v in vars(args).items() if k != "out"}, "accuracy": [], "speed": []}
  if "accuracy" in sections:
    result["accuracy"] = run_accuracy(args)
    print(f"\nINT8 weight scaling, SQNR vs float64 in dB (M,K,N = {args.acc_shape})")
    print(table(result["accuracy"], ["channel_spread", "case", "output", "grad_input", "grad_weight"]))
  if "speed" in sections:
    mesh = fsdp.make_mesh(fsdp=-1, data=args.data)
    print(f"\nspeed: {dict(mesh.shape)} mesh of {jax.devices()[0].device_kind}, {args.layers} blocks "
          f"D={args.dim} H={args.hidden}, {args.batch}x{args.seq} tokens per device", flush=True)
    if mesh.shape["fsdp"] == 1:
      print("  (one device on the FSDP axis: nothing is sharded or gathered)")
    result["speed"] = run_speed(args, mesh)
    base = next((r for r in result["speed"] if r["variant"] == "bf16"), None)
    summary = []
    for r in result["speed"]:
      ops = {op: r["collectives"].get(op, {"bytes": 0, "count": 0, "dtypes": []})
             for op in ("all-gather", "reduce-scatter", "all-reduce")}
      gather_bytes = ops["all-gather"]["bytes"]
      summary.append({
          "variant": r["variant"],
          "gathers": ops["all-gather"]["count"],
          "types": "/".join(ops["all-gather"]["dtypes"]),
          "all-gather MiB": gather_bytes / 2**20,
          "x bf16": gather_bytes / base["collectives"]["all-gather"]["bytes"] if base and gather_bytes else None,
          "reduce-scatter MiB": ops["reduce-scatter"]["bytes"] / 2**20,
          "all-reduce MiB": ops["all-reduce"]["bytes"] / 2**20,
          "step ms": r["step_ms"],
          "speed-up": base["step_ms"] / r["step_ms"] if base else None,
          "tokens/s/device": r["tokens_per_s_per_device"],
      })
    print("\nFSDP per training step (collectives per step, loops counted; all-gather MiB = what each "
          "device receives; x bf16 = relative to the bf16 row)")
    print(table(summary, list(summary[0])))
  path = write_json("fsdp", result["speed"], out=args.out, accuracy=result["accuracy"], args=result["args"],
                    device_count=jax.device_count())
  print(f"\nwrote {path}")
  return result


if __name__ == "__main__":
  sys.exit(main() and 0)
