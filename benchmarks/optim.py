"""Optimizer state memory and step time: float32 AdamW vs 8-bit, 4-bit and FP8 AdamW.

The parameter shapes are a Llama-style 1B model's (TinyLlama 1.1B: d_model 2048, 22 layers,
GQA 32 query / 4 key-value heads of 64, SwiGLU hidden 5632, vocabulary 32000, untied head),
with the layers stacked on a leading axis as ``nn.scan`` stores them. One timed step is the
whole optimizer step as the trainer takes it, ``optim.apply_step`` (the low-bit optimizers'
fused step: on a GPU one kernel per tensor that also writes the parameter); ``--apply update``
times ``tx.update`` then ``optax.apply_updates`` instead, ``both`` both. Jitted with the
parameters and state donated; the figure is the median of ``--repeats`` runs after ``--warmup``.

    PYTHONPATH=. python benchmarks/optim.py --out results/optim.json            # GPU, full 1B
    PYTHONPATH=. python benchmarks/optim.py --layers 1 --vocab 4096 --out /tmp/o.json   # CPU smoke

``--fused both`` (the default) runs every low-bit optimizer twice: its update in the fused
kernel (``JAXLOWBIT_BACKEND=pallas``: ``pallas_kernels.adam`` wherever the policy and the shape
allow) and in XLA (``JAXLOWBIT_BACKEND=xla``); ``on``/``off`` run one of them, ``auto`` what the
policy picks. The table's ``update`` column says which ran, read from the lowered step (``fused``
when the kernel is in it). ``--param-dtype bfloat16`` times bf16 parameters with stochastic
rounding (``optim.make(..., stochastic_rounding_seed=0)``). ``--tune`` first times the kernel alone
over launch configurations on the largest tensor, then runs the steps with each format's fastest
(set in ``pallas_kernels.tuning.ADAM_CONFIGS`` for this process; the JSON records which).

``--encode`` adds the quantizer micro-benchmark: the dynamic map's nearest code computed
arithmetically (what the optimizers use) vs ``searchsorted`` over the code table.
The table is printed last; ``--out`` gets the same numbers as JSON.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import math
import os
import platform
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import optax

from benchmarks import common
from jaxlowbit import optim, qstate
from jaxlowbit_numerics.adam import adam_coefficients
from pallas_kernels import adam as adam_kernels
from pallas_kernels import policy, tuning

# TinyLlama-1.1B-style shapes, one row per parameter: (name, shape per layer or None, stacked?).
D_MODEL, N_LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM, D_FF, VOCAB = 2048, 22, 32, 4, 64, 5632, 32000


def model_shapes(layers: int = N_LAYERS, vocab: int = VOCAB) -> dict[str, tuple[int, ...]]:
  """The parameter table: name -> shape (layer parameters carry a leading ``[layers]`` axis)."""
  d, q, kv = D_MODEL, N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
  per_layer = {
      "layers.attn_norm": (d,),
      "layers.attn.q": (d, q),
      "layers.attn.k": (d, kv),
      "layers.attn.v": (d, kv),
      "layers.attn.out": (q, d),
      "layers.mlp_norm": (d,),
      "layers.mlp.gate": (d, D_FF),
      "layers.mlp.up": (d, D_FF),
      "layers.mlp.down": (D_FF, d),
  }
  shapes = {"embed": (vocab, d)}
  shapes.update({name: (layers, *shape) for name, shape in per_layer.items()})
  shapes.update({"final_norm": (d,), "lm_head": (d, vocab)})
  return shapes


OPTIMIZERS = ["adamw", "adamw_8bit", "adamw_4bit", "adamw_fp8", "adamw_fp8_o2"]
# --fused: the JAXLOWBIT_BACKEND each run of a low-bit optimizer traces under (None: as set).
FUSED_MODES = {"on": ["pallas"], "off": ["xla"], "both": ["pallas", "xla"], "auto": [None]}
# The fused kernels' names in lowered HLO (pallas_kernels.adam): the update alone, and the step
# that also writes the parameter.
KERNEL_NAMES = {"fused": "jaxlowbit_adam_update", "step": "jaxlowbit_adam_step"}
# Launch configurations --tune tries: elements per program x warps.
TUNE_ELEMENTS, TUNE_WARPS = (1024, 2048, 4096), (2, 4, 8)
MAX_PER_THREAD = 64  # elements per thread beyond which Triton's unrolled program took minutes to compile (H200)
TUNE_OPTIMIZERS = ("adamw_8bit", "adamw_4bit", "adamw_fp8")


def _arrays(shapes, key, scale, dtype=jnp.float32):
  keys = jax.random.split(key, len(shapes))
  return {
      name: jax.jit(lambda k, s=shape: (jax.random.normal(k, s, jnp.float32) * scale).astype(dtype))(k)
      for k, (name, shape) in zip(keys, shapes.items())
  }


class _backend:
  """``with _backend("xla"):`` sets ``$JAXLOWBIT_BACKEND`` (read when a step is traced); None leaves it."""

  def __init__(self, value):
    self.value, self.old = value, None

  def __enter__(self):
    self.old = os.environ.get(policy.BACKEND_ENV)
    if self.value is not None:
      os.environ[policy.BACKEND_ENV] = self.value

  def __exit__(self, *exc):
    if self.old is None:
      os.environ.pop(policy.BACKEND_ENV, None)
    else:
      os.environ[policy.BACKEND_ENV] = self.old


def top_kernels(step, args, steps: int = 3, top: int = 8) -> list[dict]:
  """The ``top`` device kernels of ``steps`` calls of ``step(*args)`` by total time (jax.profiler
  trace read back in Python, as benchmarks/profile_step.py does), ms per step each."""
  from benchmarks.profile_step import device_kernels

  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for _ in range(steps):
        args = jax.block_until_ready(step(*args))
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    profile = jax.profiler.ProfileData.from_file(max(files, key=os.path.getmtime))
    totals = collections.Counter()
    for kernel, _, duration, _ in device_kernels(profile):
      totals[kernel] += duration
  return [{"kernel": k, "ms_per_step": ns / 1e6 / steps} for k, ns in totals.most_common(top)]


def bench_optimizer(name: str, shapes, repeats: int, warmup: int, profile: bool = False, backend: str | None = None,
                    param_dtype=jnp.float32, apply: str = "step") -> dict:
  """Time one optimizer's step; ``backend`` is the ``$JAXLOWBIT_BACKEND`` its step is traced under;
  ``apply``: ``"step"`` (``optim.apply_step``: the fused step, parameter written by the kernel) or
  ``"update"`` (``tx.update`` then ``optax.apply_updates``)."""
  rounding = 0 if jnp.dtype(param_dtype) == jnp.bfloat16 else None
  tx = optim.make(name, 1e-4, weight_decay=0.1, stochastic_rounding_seed=rounding)
  abstract = {n: jax.ShapeDtypeStruct(s, param_dtype) for n, s in shapes.items()}
  state_bytes = qstate.nbytes(jax.eval_shape(tx.init, abstract))
  params = _arrays(shapes, jax.random.key(0), 0.02, param_dtype)
  grads = _arrays(shapes, jax.random.key(1), 1e-3, param_dtype)
  state = jax.jit(tx.init)(params)

  def step(params, state, grads):
    if apply == "step":
      return optim.apply_step(tx, grads, state, params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = jax.jit(step, donate_argnums=(0, 1))
  with _backend(backend):  # the policy is read while tracing: the first call fixes the update
    text = step.lower(params, state, grads).as_text()
    fused = next((label for label, kernel in KERNEL_NAMES.items() if kernel in text), None)
    t0 = time.perf_counter()
    params, state = jax.block_until_ready(step(params, state, grads))
    compile_s = time.perf_counter() - t0
  for _ in range(warmup):
    params, state = jax.block_until_ready(step(params, state, grads))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    params, state = jax.block_until_ready(step(params, state, grads))
    times.append(time.perf_counter() - t0)
  finite = bool(all(jnp.all(jnp.isfinite(p)) for p in jax.tree.leaves(params)))
  kernels = top_kernels(lambda p, s: step(p, s, grads), (params, state)) if profile else []
  del params, state, grads
  return {
      "top_kernels": kernels,
      "optimizer": name,
      "update": fused or "xla",
      "apply": apply,
      "backend_env": backend,
      "param_dtype": jnp.dtype(param_dtype).name,
      "state_bytes": state_bytes,
      "step_ms_median": 1e3 * statistics.median(times),
      "step_ms_min": 1e3 * min(times),
      "compile_and_first_s": compile_s,
      "finite": finite,
  }


def bench_encode(n: int, repeats: int) -> list[dict]:
  """XLA, on ``n`` float32 values: quantize block-wise with both nearest-code methods, and
  dequantize with both decodes of a dynamic map (computed, or gathered from the table as the fused
  kernel does). ms, median."""
  x = jax.random.normal(jax.random.key(2), (n // 2048, 2048))
  rows = []
  for fmt in (qstate.BlockFormat("dynamic", 8, True, 256), qstate.BlockFormat("dynamic", 4, True, 128)):
    runs = {f"encode {method}": jax.jit(lambda a, fmt=fmt, method=method: qstate.quantize_blockwise(a, fmt, method))
            for method in ("arithmetic", "searchsorted")}
    q = runs["encode arithmetic"](x)
    codes = (qstate.unpack_4bit(q.codes) if fmt.storage_bits == 4 else q.codes).reshape(-1, fmt.block)
    table = jnp.asarray(qstate.code_table(fmt))
    for method, t in (("arithmetic", None), ("table", table)):
      runs[f"decode {method}"] = jax.jit(lambda c, s, fmt=fmt, t=t: qstate.decode_values(c, s[..., None], fmt, t))
    for label, f in runs.items():
      args = (x,) if label.startswith("encode") else (codes, q.scale.reshape(-1))
      jax.block_until_ready(f(*args))
      times = []
      for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
      ms = 1e3 * statistics.median(times)
      rows.append({"map": f"dynamic{fmt.bits}", "method": label, "elements": n, "ms_median": ms})
  return rows


def bench_tune(shapes, repeats: int) -> list[dict]:
  """The fused step kernel alone (``adam_step_kernel``, what ``optim.apply_step`` runs) on the
  largest tensor with float32 parameters, per (formats, elements, warps): ms and GB/s of the bytes
  it must move (gradient in; codes, scales and parameter in and out), its buffers donated."""
  name, shape = max(shapes.items(), key=lambda item: math.prod(item[1]))
  g = _arrays({name: shape}, jax.random.key(3), 1e-3)[name]
  c = adam_coefficients(0.9, 0.999, 1e-8, 0.0, jnp.int32(10), jnp.int32(11))
  rows = []
  for label in TUNE_OPTIMIZERS:
    m_format, v_format = optim.moment_formats(label)
    quantize = jax.jit(qstate.quantize_blockwise, static_argnums=1)
    states = [jax.eval_shape(quantize, g, fmt) for fmt in (m_format, v_format)]
    moved = g.size * 4 + 2 * (qstate.nbytes(states) + g.size * 4)
    for elements in TUNE_ELEMENTS:
      for warps in (w for w in TUNE_WARPS if elements <= MAX_PER_THREAD * 32 * w):
        config = adam_kernels.AdamKernelConfig(elements, warps)
        step = jax.jit(lambda p, m, v, g, mf=m_format, vf=v_format, cf=config: adam_kernels.adam_step_kernel(
            p, g, m, v, c, jnp.float32(-1e-3), jnp.float32(0.1), None, mf, vf, False, cf), donate_argnums=(0, 1, 2))
        state = [(g * 10.0, quantize(g, m_format), quantize(g * g, v_format))]

        def advance(step=step, state=state):
          state[0] = step(*state[0], g)  # g an argument: closed over, it would be a 1 GB constant
          return state[0]

        try:
          ms = common.time_ms(advance, reps=max(repeats // 4, 3))
        except Exception as e:  # noqa: BLE001  (a config the compiler refuses is a result, not a crash)
          rows.append({"formats": label, "elements": elements, "num_warps": warps, "error": str(e)[:200]})
          continue
        rows.append({"formats": label, "tensor": name, "shape": list(shape), "elements": elements, "num_warps": warps,
                     "ms": ms, "gb_per_s": moved / ms / 1e6})
        print(f"tune {label:<11} elements {elements:>6} warps {warps}: {ms:.3f} ms {moved / ms / 1e6:7.0f} GB/s",
              flush=True)
  return rows


def apply_best(tune: list[dict]) -> dict[str, dict]:
  """Each format's fastest row of ``tune``, set in ``tuning.ADAM_CONFIGS`` for the rest of the process."""
  best = {}
  for t in (t for t in tune if "ms" in t):
    best[t["formats"]] = min(best.get(t["formats"], t), t, key=lambda x: x["ms"])
  for label, t in best.items():
    key = tuning.adam_config_key(*optim.moment_formats(label))
    tuning.ADAM_CONFIGS[key] = adam_kernels.AdamKernelConfig(t["elements"], t["num_warps"])
  return best


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True, help="JSON file to write")
  parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated jaxlowbit.optim.make names")
  parser.add_argument("--layers", type=int, default=N_LAYERS, help="transformer layers (22 for the 1B model)")
  parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary rows of the embedding and LM head")
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--encode", type=int, default=0,
                      help="also time XLA's encode (nearest-code methods) and decode (computed, table) on this "
                      "many elements")
  parser.add_argument("--profile", action="store_true", help="trace 3 steps per optimizer; JSON gets its top kernels")
  parser.add_argument("--fused", choices=sorted(FUSED_MODES), default="both",
                      help="low-bit updates in the fused kernel (on), in XLA (off), both, or the policy's pick (auto)")
  parser.add_argument("--param-dtype", choices=["float32", "bfloat16"], default="float32",
                      help="parameter dtype; bfloat16 adds stochastic rounding to the step")
  parser.add_argument("--apply", choices=["step", "update", "both"], default="step",
                      help="optim.apply_step (the fused step), tx.update + optax.apply_updates, or both")
  parser.add_argument("--tune", action="store_true",
                      help="first time the fused step kernel alone per launch configuration; the run then uses "
                      "the best")
  args = parser.parse_args(argv)

  shapes = model_shapes(args.layers, args.vocab)
  n_params = sum(math.prod(s) for s in shapes.values())
  tune = bench_tune(shapes, args.repeats) if args.tune else []
  chosen = apply_best(tune)
  results = []
  for name in (n.strip() for n in args.optimizers.split(",")):
    applies = ["update"] if name == "adamw" else (["step", "update"] if args.apply == "both" else [args.apply])
    for backend in [None] if name == "adamw" else FUSED_MODES[args.fused]:
      for apply in applies:
        results.append(bench_optimizer(name, shapes, args.repeats, args.warmup, args.profile, backend,
                                       jnp.dtype(args.param_dtype), apply))
        print(f"done {name} ({results[-1]['update']}): {results[-1]['step_ms_median']:.2f} ms", flush=True)
  base = next((r for r in results if r["optimizer"] == "adamw"), results[0])
  for r in results:
    r["state_vs_adamw"] = r["state_bytes"] / base["state_bytes"]
    r["time_vs_adamw"] = r["step_ms_median"] / base["step_ms_median"]
    r["state_bytes_per_param"] = r["state_bytes"] / n_params
    unfused = [x for x in results
               if x["optimizer"] == r["optimizer"] and x["backend_env"] == "xla" and x["apply"] == r["apply"]]
    r["time_vs_xla_update"] = r["step_ms_median"] / unfused[0]["step_ms_median"] if unfused else None
  encode = bench_encode(args.encode, args.repeats) if args.encode else []

  report = {
      "benchmark": "optim",
      "device": str(jax.devices()[0].device_kind),
      "platform": jax.default_backend(),
      "jax": jax.__version__,
      "python": platform.python_version(),
      "shapes": {k: list(v) for k, v in shapes.items()},
      "n_params": n_params,
      "repeats": args.repeats,
      "commit": common.commit(),
      "date": time.strftime("%Y-%m-%d"),
      "fused": args.fused,
      "param_dtype": args.param_dtype,
      "results": results,
      "encode": encode,
      "tune": tune,
      "tuned_configs": chosen,
  }
  with open(args.out, "w") as f:
    json.dump(report, f, indent=2)

  print(f"\n{report['device']} ({report['platform']}), jax {report['jax']}, {n_params / 1e9:.3f}B parameters, "
        f"median of {args.repeats} steps, {args.param_dtype} parameters")  # fmt: skip
  if encode:
    print(f"\n{'map':<10} {'method':<20} {'ms / ' + format(args.encode, ',') + ' values':>22}")
    for e in encode:
      print(f"{e['map']:<10} {e['method']:<20} {e['ms_median']:>22.2f}")
  # "asked": the JAXLOWBIT_BACKEND of the run; "update": what ran (step: the kernel writing the
  # parameter; fused: the update kernel; xla), "vs xla": the step time against the same optimizer's
  # XLA run of the same kind (apply_step or update + apply_updates).
  header = ("optimizer", "asked", "apply", "update", "state GB", "B/param", "vs adamw", "step ms", "vs adamw", "vs xla",
            "finite")
  print("\n{:<14} {:<6} {:<6} {:<6} {:>9} {:>8} {:>9} {:>9} {:>9} {:>7} {:>7}".format(*header))
  for r in results:
    row = (r["optimizer"], r["backend_env"] or "-", r["apply"], r["update"], r["state_bytes"] / 1e9,
           r["state_bytes_per_param"])
    row += (r["state_vs_adamw"], r["step_ms_median"], r["time_vs_adamw"])
    vs_xla = "-" if r["time_vs_xla_update"] is None else f"{r['time_vs_xla_update']:.2f}x"
    print("{:<14} {:<6} {:<6} {:<6} {:>9.3f} {:>8.2f} {:>8.3f}x {:>9.2f} {:>8.2f}x {:>7} {:>7}".format(*row, vs_xla,
                                                                                             str(r["finite"])))
  for label, t in chosen.items():
    print(f"best {label} (the steps above ran it): elements {t['elements']}, num_warps {t['num_warps']}: "
          f"{t['ms']:.3f} ms, {t['gb_per_s']:.0f} GB/s")
  for r in results:
    for k in r["top_kernels"][:4]:
      print(f"  {r['optimizer']:<14} {k['ms_per_step']:8.2f} ms  {k['kernel'][:90]}")


if __name__ == "__main__":
  main()
