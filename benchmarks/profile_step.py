"""Where the trainer's step spends its time: a ``jax.profiler`` trace of ``train.main``'s own step, per config.

    PYTHONPATH=. python benchmarks/profile_step.py --out benchmarks/results/profile_1b.json
    PYTHONPATH=. python benchmarks/profile_step.py --runs bf16=configs/bf16_1b.py,int8=configs/int8_1b.py \\
        --set model.scan_layers=False --out /tmp/p.json

For every run (a name, a config file, optional ``KEY=VALUE`` overrides) it builds the trainer's
jitted step (``train.steps.step_functions``: what ``python -m train.main`` runs, on synthetic
batches), compiles it (timed), times ``--steps`` steps, then traces ``--trace_steps`` more with
``jax.profiler`` and reads the trace back in Python (``jax.profiler.ProfileData``, no TensorBoard).

Each device kernel is put in one category, from its kernel name and from the ``op_name`` that the
compiled HLO records for the XLA op that launched it (jaxlowbit and the model name their pieces
with ``jax.named_scope``, so the categories follow the code, not guesses about fusion names):

==============  =============================================================================
category        what
==============  =============================================================================
gemm_fwd        forward matmuls (cuBLAS, XLA Triton GEMMs, jaxlowbit's Mosaic GPU GEMM and Pallas GEMVs)
gemm_grad_input backward ``dx = g W^T``
gemm_grad_weight backward ``dW = x^T g``
quantize        jaxlowbit quantization passes (Pallas kernels and XLA fusions in its scopes)
attention       cuDNN flash attention (or XLA's) forward and backward
norm            RMSNorm forward and backward fusions
copy            memcpy, dynamic-update-slice, transposes and copies XLA inserts
collective      all-gather, reduce-scatter, all-reduce (NCCL)
optimizer       the optimizer update, gradient clipping and accumulation
elementwise     everything else (SwiGLU, RoPE, residual adds, embedding, loss, ...)
idle            time in the traced span when no kernel ran on any stream
==============  =============================================================================

With several GPUs (``--set mesh.fsdp=2``, ``mesh.tensor=2``) every figure is per GPU: the trace's
devices are averaged. Where collectives ran, the row also gives their timeline per GPU: ms per step
of each kind (all-gather, reduce-scatter, all-reduce) and how much of it was *exposed*, i.e. ran
while that GPU ran no other kernel (the step waited for the network), against what overlapped
compute (issue 29).

Prints a table last (ms per step per category) and writes JSON with every category, the top
kernels by time and the throughput. On CPU (``--runs tiny=configs/tiny.py --steps 2``) it checks
that it runs; the categories there are XLA:CPU thunks, not GPU kernels.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gc
import glob
import os
import re
import sys
import tempfile
import time
import traceback

# XLA:GPU launches a module's kernels as CUDA graphs (command buffers); a trace then names the
# graph, not the HLO op behind each kernel. This tool turns them off for its whole run (before jax starts), so
# the step times here run without graphs; benchmarks/train_throughput.py times with them. Another tool can compile
# just the executable it traces without them: ``lowered.compile(compiler_options=GRAPHLESS)``
# (benchmarks/inference.py --profile-decode), and time the one with graphs.
GRAPHLESS = {"xla_gpu_enable_command_buffer": ""}
if __name__ == "__main__" and "--keep_command_buffers" not in sys.argv:
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="

import jax  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.train_throughput import parse_overrides  # noqa: E402
from train import config as train_config  # noqa: E402
from train import data, metrics  # noqa: E402
from train.model import train_flops_per_token  # noqa: E402
from train.spec import resolve  # noqa: E402
from train.steps import step_functions  # noqa: E402

CATEGORIES = (
    "gemm_fwd", "gemm_grad_input", "gemm_grad_weight", "quantize", "attention", "norm", "copy", "collective",
    "optimizer", "elementwise", "idle",
)
DEFAULT_RUNS = "bf16=configs/bf16_1b.py,int8=configs/int8_1b.py,fp8=configs/fp8_1b.py,bitnet=configs/bitnet_1b.py"
TOP_KERNELS = 40

# Kernel-name patterns (lower case) that identify a category whatever op launched them.
# (^dot.N: XLA:CPU's dot thunks.)
_GEMM_KERNELS = re.compile(r"^dot(\.\d+)?$|gemm|gemv|nvjet|cutlass|xmma|wgmma|sm90_|ampere_|cublas|matmul|triton_dot"
                           r"|scaled_matmul")
_ATTENTION_KERNELS = re.compile(r"flash|fmha|cudnn|attention|sdpa")
_COPY_KERNELS = re.compile(r"memcpy|memset|dynamic.update.slice|dynamic_update_slice|transpose|copy")
# XLA's attention (jax.nn.dot_product_attention, implementation="xla") shows as these einsums.
_ATTENTION_SCOPES = re.compile(r"dot_product_attention|bnts|attention_core")
_COLLECTIVE_KERNELS = re.compile(r"nccl|all.gather|all_gather|reduce.scatter|reduce_scatter|all.reduce|all_reduce")


def hlo_op_names(hlo_text: str) -> dict[str, str]:
  """``{HLO instruction name: op_name metadata}`` of a compiled module's text."""
  names = {}
  for line in hlo_text.splitlines():
    match = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
    if not match:
      continue
    meta = re.search(r'op_name="([^"]*)"', line)
    names[match.group(1)] = meta.group(1) if meta else ""
  return names


def gemm_kind(op_name: str, output_shape: tuple[int, ...] | None, tokens: tuple[int, ...]) -> str:
  """fwd / grad_input / grad_weight of a GEMM from its op_name (jaxlowbit scopes, autodiff) and shape.

  ``tokens``: the token counts a device's activations may have (the microbatch's, and its share under FSDP).
  """
  if "grad_weight" in op_name:
    return "gemm_grad_weight"
  if "grad_input" in op_name:
    return "gemm_grad_input"
  if "transpose(" not in op_name and "bwd" not in op_name:
    return "gemm_fwd"
  # Autodiff of a plain dot: dW has no token dimension, dx has one.
  if output_shape is not None and not any(t in output_shape for t in tokens):
    return "gemm_grad_weight"
  return "gemm_grad_input"


def hlo_output_shapes(hlo_text: str) -> dict[str, tuple[int, ...]]:
  """``{instruction: output shape}``: its one array output, or a tuple's first (a cuBLAS GEMM's custom call
  returns its result and a workspace)."""
  shapes = {}
  for line in hlo_text.splitlines():
    match = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?\w+\[([\d,]*)\]", line)
    if match:
      shapes[match.group(1)] = tuple(int(d) for d in match.group(2).split(",") if d)
  return shapes


def categorize(kernel: str, op_name: str, shape, tokens: tuple[int, ...]) -> str:
  """The category of one kernel (module docstring)."""
  name, scope = kernel.lower(), op_name.lower()
  if _COLLECTIVE_KERNELS.search(name) or _COLLECTIVE_KERNELS.search(scope):
    return "collective"
  if "quantize" in name or "/quantize" in scope or "jaxlowbit_quantize" in scope:
    return "quantize"
  if _ATTENTION_KERNELS.search(name):
    return "attention"
  if _ATTENTION_SCOPES.search(scope):
    return "attention"
  if _GEMM_KERNELS.search(name) or "jaxlowbit_gemm" in scope or scope.endswith("dot_general"):
    return gemm_kind(scope, shape, tokens)
  if "optimizer" in scope or "grad_accum" in scope:
    return "optimizer"
  if _COPY_KERNELS.search(name):
    return "copy"
  if "norm" in scope:
    return "norm"
  return "elementwise"


def device_kernels(profile) -> list[tuple[str, int, int, dict]]:
  """``(name, start_ns, duration_ns, stats)`` of every kernel on a GPU stream (XLA:CPU: every thunk)."""
  kernels = []
  for plane in profile.planes:
    on_gpu = plane.name.startswith("/device:GPU")
    if not on_gpu and plane.name != "/host:CPU":
      continue
    for line in plane.lines:
      if on_gpu and not line.name.lower().startswith("stream"):
        continue
      for event in line.events:
        stats = dict(event.stats)
        # XLA:CPU: thunks only; a while/call thunk encloses its body's thunks (counted already).
        if not on_gpu and ("hlo_op" not in stats or re.match(r"(while|call|conditional)\b", event.name)):
          continue
        stats["device"] = plane.name
        kernels.append((event.name, int(event.start_ns), int(event.duration_ns), stats))
  return kernels


def _merged(intervals) -> list[tuple[int, int]]:
  """Sorted, disjoint union of ``(start, end)`` intervals."""
  merged = []
  for start, end in sorted(intervals):
    if merged and start <= merged[-1][1]:
      merged[-1] = (merged[-1][0], max(merged[-1][1], end))
    else:
      merged.append((start, end))
  return merged


def _covered_ns(start: int, end: int, merged: list[tuple[int, int]]) -> int:
  """How much of ``[start, end)`` the disjoint sorted ``merged`` intervals cover."""
  i = bisect.bisect_right(merged, (start, float("inf"))) - 1
  covered = 0
  for lo, hi in merged[max(i, 0):]:
    if lo >= end:
      break
    covered += max(0, min(hi, end) - max(lo, start))
  return covered


# (what a kernel or HLO op name holds once lower-cased without '-' and '_', the collective's kind)
_COLLECTIVE_KINDS = (("allgather", "all_gather"), ("reducescatter", "reduce_scatter"), ("allreduce", "all_reduce"))


def collective_kind(kernel: str, hlo_op: str) -> str:
  """all_gather / reduce_scatter / all_reduce / other of a collective kernel, from its name or HLO op."""
  text = f"{kernel} {hlo_op}".lower().replace("-", "").replace("_", "")
  return next((kind for needle, kind in _COLLECTIVE_KINDS if needle in text), "other")


def _by_device(kernels, categories=None) -> dict[str, list]:
  """``{device: [(kernel, category), ...]}`` (category None without ``categories``), in trace order."""
  grouped = collections.defaultdict(list)
  for kernel, category in zip(kernels, categories or [None] * len(kernels)):
    grouped[kernel[3].get("device", "")].append((kernel, category))
  return grouped


def collective_timeline(kernels, categories: list[str], steps: int) -> dict:
  """Per GPU and step: ms of each collective kind, and how much of it no other kernel on that GPU overlapped.

  ``exposed`` is the time during which a collective ran and the device ran no compute kernel (any other
  category): what the step waits for communication. Collectives that overlap each other count once there (the
  union of their intervals, per kind and in ``exposed_ms``); ``ms_per_step`` and ``total_ms`` sum the kernels'
  own durations. Averaged over the devices in the trace.
  """
  devices = _by_device(kernels, categories)
  totals, exposed = collections.Counter(), collections.Counter()
  exposed_total = 0
  for mine in devices.values():
    compute = _merged((start, start + duration) for (_, start, duration, _), c in mine if c != "collective")
    by_kind = collections.defaultdict(list)
    for (name, start, duration, stats), category in mine:
      if category == "collective":
        kind = collective_kind(name, str(stats.get("hlo_op", "")))
        totals[kind] += duration
        by_kind[kind].append((start, start + duration))

    def uncovered(intervals, compute=compute):
      return sum(end - start - _covered_ns(start, end, compute) for start, end in _merged(intervals))

    for kind, intervals in by_kind.items():
      exposed[kind] += uncovered(intervals)
    exposed_total += uncovered([i for intervals in by_kind.values() for i in intervals])
  scale = 1e6 * steps * max(len(devices), 1)
  kinds = sorted(totals)
  return {"devices": len(devices),
          "ms_per_step": {k: totals[k] / scale for k in kinds},
          "exposed_ms_per_step": {k: exposed[k] / scale for k in kinds},
          "total_ms": sum(totals.values()) / scale, "exposed_ms": exposed_total / scale}


def busy_ns(kernels) -> tuple[int, int]:
  """(union of kernel intervals, span from the first start to the last end) in ns, summed over the devices.

  Each device's own span counts: two GPUs that each idle 1 ms of a 10 ms step give 2 ms idle of 20.
  """
  busy = span = 0
  for mine in _by_device(kernels).values():
    merged = _merged((start, start + duration) for (_, start, duration, _), _ in mine)
    busy += sum(end - start for start, end in merged)
    span += merged[-1][1] - merged[0][0]
  return busy, span


def traced_kernels(run) -> list[tuple[str, int, int, dict]]:
  """:func:`device_kernels` of a ``jax.profiler`` trace around ``run()`` (which blocks until its work is done)."""
  with tempfile.TemporaryDirectory(prefix="jaxlowbit_trace_") as trace_dir:
    with jax.profiler.trace(trace_dir):
      run()
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    return device_kernels(jax.profiler.ProfileData.from_file(max(files, key=os.path.getmtime)))


def breakdown(kernels, op_names: dict[str, str], shapes: dict, tokens: tuple[int, ...], steps: int) -> dict:
  """Per-category ms per step and GPU (averaged over the traced devices), the top kernels by total time and,
  where collectives ran, their :func:`collective_timeline`."""
  per_category = collections.Counter()
  per_kernel = collections.Counter()
  example_scope = {}
  categories = []
  for name, _, duration, stats in kernels:
    hlo_op = str(stats.get("hlo_op", ""))
    op_name = op_names.get(hlo_op, "")
    category = categorize(name, op_name, shapes.get(hlo_op), tokens)
    categories.append(category)
    per_category[category] += duration
    key = (category, name[:120])
    per_kernel[key] += duration
    example_scope.setdefault(key, f"{hlo_op} {op_name[-160:]}")
  busy, span = busy_ns(kernels)
  per_category["idle"] += max(span - busy, 0)
  devices = max(len(_by_device(kernels)), 1)
  scale = 1e6 * steps * devices
  ms = {c: per_category[c] / scale for c in CATEGORIES}
  top = [
      {"category": c, "kernel": k, "ms_per_step": t / scale, "hlo": example_scope[(c, k)]}
      for (c, k), t in per_kernel.most_common(TOP_KERNELS)
  ]
  result = {"ms_per_step": ms, "kernel_ms_per_step": sum(v for c, v in ms.items() if c != "idle"),
            "span_ms_per_step": span / scale, "devices": devices, "top_kernels": top}
  if "collective" in categories:
    result["collectives"] = collective_timeline(kernels, categories, steps)
  return result


def profile_one(config, steps: int, warmup: int, trace_steps: int, peak: float | None) -> dict:
  """Compile, time and trace the trainer's step for ``config``."""
  spec = resolve(config)
  functions = step_functions(spec)
  stream = data.SyntheticBatches(config.seq_len, config.batch_size, config.seed)
  batches = [functions.shard_train_batch(stream.next()) for _ in range(warmup + steps + trace_steps)]
  state = functions.init()
  started = time.perf_counter()
  compiled = functions.train_step.lower(state, batches[0]).compile()
  compile_s = time.perf_counter() - started
  hlo_text = compiled.as_text()
  op_names, shapes = hlo_op_names(hlo_text), hlo_output_shapes(hlo_text)

  for batch in batches[:warmup]:
    state, step_metrics = compiled(state, batch)
  jax.block_until_ready((state, step_metrics))
  started = time.perf_counter()
  for batch in batches[warmup : warmup + steps]:
    state, step_metrics = compiled(state, batch)
  jax.block_until_ready((state, step_metrics))
  step_time = (time.perf_counter() - started) / steps

  def traced_steps():
    nonlocal state, step_metrics
    for batch in batches[warmup + steps :]:
      state, step_metrics = compiled(state, batch)
    jax.block_until_ready((state, step_metrics))

  kernels = traced_kernels(traced_steps)
  micro_tokens = config.batch_size // config.grad_accum_steps * config.seq_len
  # A device's GEMMs see the microbatch's tokens (tensor parallelism gathers them) or its share of them (FSDP).
  tokens = (micro_tokens, micro_tokens // functions.runtime.num_devices)
  result = breakdown(kernels, op_names, shapes, tokens, trace_steps)

  tokens_per_step = config.batch_size * config.seq_len
  flops = train_flops_per_token(spec.model, config.seq_len) * tokens_per_step
  devices = functions.runtime.num_devices
  result.update(
      recipe=config.recipe,
      step_ms=1e3 * step_time,
      tokens_per_s=tokens_per_step / step_time,
      mfu=metrics.mfu(flops, step_time, peak, devices),
      compile_s=compile_s,
      loss=float(step_metrics["loss"]),
  )
  return result


def format_table(rows: list[dict]) -> str:
  columns = ["run", "tok/s", "vs first", "MFU", "step ms", "compile s", *CATEGORIES]
  ok = [r for r in rows if "error" not in r]
  base = ok[0]["tokens_per_s"] if ok else None
  table_rows = []
  for r in rows:
    if "error" in r:
      table_rows.append({"run": r["name"], "tok/s": "error: " + r["error"][:80]})
      continue
    row = {
        "run": r["name"], "tok/s": f"{r['tokens_per_s']:,.0f}", "vs first": f"{r['tokens_per_s'] / base:.2f}x",
        "MFU": "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%", "step ms": f"{r['step_ms']:.1f}",
        "compile s": f"{r['compile_s']:.0f}",
    }
    row.update({c: f"{r['ms_per_step'][c]:.1f}" for c in CATEGORIES})
    table_rows.append(row)
  return common.table(table_rows, columns) + "\n(category columns: kernel ms per step, from the trace)"


def parse_runs(text: str) -> list[tuple[str, str, dict]]:
  """``"name=config.py[;KEY=VALUE...],..."`` -> ``[(name, path, overrides)]``."""
  runs = []
  for item in text.split(","):
    if not item:
      continue
    name, _, rest = item.partition("=")
    path, *pairs = rest.split(";")
    runs.append((name, path, parse_overrides(pairs)))
  return runs


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", default=DEFAULT_RUNS,
                      help="comma-separated NAME=CONFIG[;KEY=VALUE...], e.g. int8=configs/int8_1b.py;grad_accum_steps=1")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override in every run")
  parser.add_argument("--steps", type=int, default=10, help="timed steps (throughput)")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--trace_steps", type=int, default=3, help="steps inside the profiler trace")
  parser.add_argument("--out", required=True, help="JSON file to write")
  parser.add_argument("--keep_command_buffers", action="store_true",
                      help="keep XLA's CUDA graphs (kernels then cannot be attributed to HLO ops)")
  args = parser.parse_args(argv)

  shared = {"data.source": "synthetic", "mesh.fsdp": 1, **parse_overrides(args.set)}
  peak = metrics.peak_tflops()
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, bf16 peak {peak}", flush=True)
  rows = []
  for name, path, overrides in parse_runs(args.runs):
    try:
      config = train_config.load_file(path, {**shared, **overrides})
      row = {"name": name, "config": path, "overrides": {**shared, **overrides},
             **profile_one(config, args.steps, args.warmup, args.trace_steps, peak)}
      print(f"{name}: {row['tokens_per_s']:,.0f} tokens/s, {row['step_ms']:.1f} ms/step, compile "
            f"{row['compile_s']:.0f} s, loss {row['loss']:.3f}", flush=True)
    except Exception as e:  # one failing run (e.g. out of memory) must not lose the others
      traceback.print_exc()
      row = {"name": name, "config": path, "error": f"{type(e).__name__}: {e}"}
    rows.append(row)
    common.write_json("profile_step", rows, args.out)  # after every run: a later crash keeps these
    gc.collect()
  print(format_table(rows))
  timelines = []
  for r in rows:
    if "collectives" in r:
      c = r["collectives"]
      timelines.append({"run": r["name"], **{f"{k} ms": f"{v:.1f}" for k, v in c["ms_per_step"].items()},
                        "total ms": f"{c['total_ms']:.1f}", "exposed ms": f"{c['exposed_ms']:.1f}",
                        **{f"{k} exposed": f"{v:.1f}" for k, v in c["exposed_ms_per_step"].items()}})
  if timelines:
    columns = list(dict.fromkeys(c for t in timelines for c in t))
    print("\ncollectives per GPU and step (exposed: no other kernel ran on that GPU meanwhile)")
    print(common.table(timelines, columns))
  for r in rows:
    if "error" not in r:
      print(f"\n{r['name']}: top kernels (ms/step)")
      for k in r["top_kernels"][:12]:
        print(f"  {k['ms_per_step']:7.2f}  {k['category']:<17} {k['kernel'][:70]}  [{k['hlo'][-70:]}]")
  if any("error" in r for r in rows):
    sys.exit(1)


if __name__ == "__main__":
  main()
