"""Low-bit inference: one linear's latency and bandwidth per M and scheme, and 1B decode tokens/s.

    PYTHONPATH=. python benchmarks/inference.py --out benchmarks/results/inference_h100.json   # ~5 min, H100
    PYTHONPATH=. python benchmarks/inference.py --smoke --out /tmp/inference_cpu.json            # CPU, ~2 min

Every time is the median of ``--runs`` (>= 5) timed runs, with their min and max; a row whose
spread ``(max - min) / median`` exceeds 15% is marked ``unstable`` (issue 28: a swing that large is a bug).

1. Linear ``y = x @ W`` (``W`` K x N) for the Llama-3-8B MLP shapes in both orientations (4096 x 14336,
   14336 x 4096) and its attention shapes (the fused qkv 4096 x 6144, the output 4096 x 4096), at
   M = 1, 4, 16 tokens: ``bf16`` (XLA, bf16 weights) against the converted schemes run through
   ``jaxlowbit.inference.quantized_linear`` (what a converted model runs, activation quantization
   included) on the default dispatch. ``--variants`` adds ``*_xla`` (the reference path) and
   ``w8a16_kernel`` (the Triton kernel forced). Each row: microseconds on the device (a traced chain of
   ``--layers`` distinct weights: what the linear costs inside decode's CUDA graph; ``launched_us``: the
   same chain timed from the host, which dispatch bounds for small weights), the bandwidth reached
   (``(weight bytes + activation bytes in and out) / time``, GB/s) and that bandwidth as a % of the
   bf16 row's; every row is first checked against the XLA path of its scheme.
2. Weight bytes of each linear per scheme.
3. Decode tokens/s of the ~1B model (``configs/bf16_1b.py``; ``configs/bitnet_1b.py`` for ternary, which
   adds BitNet's norms), random weights, ``train.generate``'s prefill and ``lax.scan`` decode: each scheme at
   ``--decode-batches`` (1 and 8) after a ``--prompt-len`` prompt, then ``--long-schemes`` at a
   ``--long-context`` cache (2048 tokens, prompt filling all but ``--new-tokens``) with the bf16 and the
   int8 KV cache. Each decode row also counts the cache-sized buffers the compiled step writes besides the
   cache (``train.kv_cache.cache_copies``: copies, transposes, a dequantized int8 cache; 0 = read where it lies,
   written in place). ``--profile-decode`` traces :data:`PROFILE_CALLS` more decode calls per row with
   ``jax.profiler`` and splits their kernel time per generated token by ``benchmarks/profile_step.py``'s
   categories (``gemm_fwd``: the linears, GEMV kernels included; ``attention``; ``norm``; ``quantize``;
   ``copy``: the KV cache update and copies;
   ``elementwise``: RoPE, sampling, residuals; ``idle``: launch gaps): the median call's, with the kernel
   time's min and max over the calls. The traced calls run the step compiled a second time without XLA's
   CUDA graphs (``profile_step.GRAPHLESS``: a trace attributes kernels to HLO ops only then), launched kernel by
   kernel; the timed runs, and so the row's tokens/s, keep the graphs, as everywhere else.

Prints tables last, writes JSON to ``--out`` and, when matplotlib is importable, a plot next to it
(``.png``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import sys
import time
import traceback
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import table, time_samples, write_json  # noqa: E402
from jaxlowbit import inference  # noqa: E402
from pallas_kernels import dp4a_gemv, policy  # noqa: E402
from pallas_kernels.policy import BACKEND_ENV  # noqa: E402

# (K, N): Llama-3-8B's MLP up/gate and down, its fused q/k/v (4096 + 2 x 1024 outputs) and attention output.
SHAPES = ((4096, 14336), (14336, 4096), (4096, 6144), (4096, 4096))
MS = (1, 4, 16)
MIN_RUNS = 5
# A spread (max - min) / median above this marks a row unstable (issue 28).
UNSTABLE_SPREAD = 0.15
# Shortest timed run (seconds). With 10 calls of 8 chained linears a run was 1-3 ms of GPU work, and in 19 of 56
# rows on one H100 (979ba66) one run of five came out 20-60 us per linear slower than the others, i.e. a single
# stall of a few ms, of the host (it queues every call) or of the GPU, landed in it. Runs of >= 25 ms spread such
# a stall over ten times the work.
MIN_RUN_S = 0.025
ACTIVATION_BYTES = 2  # bf16 x in, bf16 y out
TOP_DECODE_KERNELS = 15  # kept per profiled decode row
PROFILE_CALLS = MIN_RUNS  # traced decode calls per profiled row (each a trace of its own; odd: one is the median)
SMOKE = dict(shapes=["256,512", "512,256"], m=[1, 4], decode_config="tiny", decode_batches=[1, 2], long_context=64,
             new_tokens=9, prompt_len=8, iters=3, layers=2)
# variant -> (scheme, forced backend or None for the default dispatch)
VARIANTS = {
    "bf16": (None, None),
    "w8a16": ("w8a16", None),
    "w8a16_kernel": ("w8a16", "pallas"),
    "w8a16_xla": ("w8a16", "xla"),
    "w8a8": ("w8a8", None),
    "w8a8_xla": ("w8a8", "xla"),
    "ternary": ("ternary", None),
    "ternary_xla": ("ternary", "xla"),
    "ternary_gemv": ("ternary", "gemv"),  # pallas_kernels.dp4a_gemv forced (M <= its MAX_M), whatever the dispatch says
}
# Issue 28 targets per linear (speed-up over bf16): (largest M it applies to, target), the first that applies.
TARGETS = {"ternary": ((1, 3.0), (16, 2.0)), "w8a16": ((1, 1.8), (16, 1.5)), "w8a8": ((1, 1.8), (16, 1.5))}


def target_for(scheme: str, m: int) -> float | None:
  return next((target for max_m, target in TARGETS.get(scheme, ()) if m <= max_m), None)
# Agreement with the scheme's XLA path: int8-activation schemes are bit-identical; w8a16 sums in
# another order (float32) and rounds to bf16 once.
CHECK_REL_ERR = {"w8a16": 1e-2, "w8a8": 1e-6, "ternary": 1e-6}
# (bf16/int8 model, ternary model). "8b_layers": Llama 3 8B's layers 4 deep (configs/layers_8b.py), the 8B decode's
# per-layer shapes (its linears, attention with 32 heads / 8 KV heads) in 3.5 GB of float32 weights.
DECODE_CONFIGS = {"1b": ("configs/bf16_1b.py", "configs/bitnet_1b.py"),
                  "8b_layers": ("configs/layers_8b.py", "configs/layers_8b.py:bitnet"),
                  "tiny": ("configs/tiny.py", "configs/tiny.py")}


def time_runs(fn, *args, iters: int, runs: int, warmup: int = 2, per_call: int = 1,
              min_run_s: float = MIN_RUN_S) -> dict:
  """Microseconds per call (divided by ``per_call``) of ``fn(*args)``: median, min and max of ``runs`` timed runs
  of back-to-back calls (no host sync inside a run), after ``warmup`` calls and two whole runs of ``iters`` calls
  discarded (the decode rows discard one). Each timed run makes at least ``iters`` calls and lasts at least
  ``min_run_s`` (:data:`MIN_RUN_S` says why); ``iters`` in the result is the count used. ``samples_us`` keeps
  every timed run, ``unstable`` when the spread exceeds :data:`UNSTABLE_SPREAD`."""
  # Seconds per call from the faster of two discarded runs (one that caught a stall would shorten the runs).
  pace = min(time_samples(fn, *args, iters=iters, reps=2, warmup=warmup))
  iters = max(iters, math.ceil(min_run_s / max(pace, 1e-9)))
  timed = time_samples(fn, *args, iters=iters, reps=runs, warmup=0)
  return {**sample_stats([s * 1e6 / per_call for s in timed]), "iters": iters}


def sample_stats(samples: list[float]) -> dict:
  """``us`` (the median), ``us_min``, ``us_max``, ``runs``, ``samples_us``, ``spread`` and ``unstable``."""
  median = float(np.median(samples))
  stats = {"us": median, "us_min": min(samples), "us_max": max(samples), "runs": len(samples), "samples_us": samples}
  stats["spread"] = (stats["us_max"] - stats["us_min"]) / median
  stats["unstable"] = stats["spread"] > UNSTABLE_SPREAD
  return stats


def gpu_times(fn, *args, calls: int, per_call: int = 1) -> dict:
  """The device's time per call of ``fn(*args)`` (divided by ``per_call``), as :func:`sample_stats` of ``calls``
  calls traced by ``jax.profiler``: each call's span from its first kernel's start to its last kernel's end
  (``busy_us``: the median of the kernels' summed durations; below the span where gaps sit between them).

  This is what a linear costs where decode runs it: inside a CUDA graph (XLA's command buffer of the decode loop),
  whose kernels follow each other with no host work between them. Timed from the host, back-to-back calls of a few
  small kernels wait on the host's dispatch instead: on an H200 a chain of 16 ternary 4096 x 4096 linears spent
  4.7 us per linear on the GPU and took 17.9 us per linear from the host
  (benchmarks/results/decode_trace_h200_e9d7263.json). ``fn`` should have run once (compiled, warm).
  """
  from benchmarks import profile_step

  def run():
    for _ in range(calls):
      jax.block_until_ready(fn(*args))

  kernels = sorted(profile_step.traced_kernels(run), key=lambda kernel: kernel[1])
  if not kernels or len(kernels) % calls:
    raise RuntimeError(f"gpu_times: {len(kernels)} traced kernels do not split into {calls} equal calls")
  n = len(kernels) // calls
  groups = [kernels[i * n:(i + 1) * n] for i in range(calls)]
  spans = [(max(start + duration for _, start, duration, _ in group) - group[0][1]) / 1e3 / per_call
           for group in groups]
  busy = [sum(duration for _, _, duration, _ in group) / 1e3 / per_call for group in groups]
  return {**sample_stats(spans), "kernels_per_call": n, "busy_us": float(np.median(busy))}


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@dataclasses.dataclass
class Backend:
  """Sets ``$JAXLOWBIT_BACKEND`` while a function is traced (dispatch reads it at trace time)."""

  value: str | None

  def __enter__(self):
    self.saved = os.environ.pop(BACKEND_ENV, None)
    if self.value:
      os.environ[BACKEND_ENV] = self.value

  def __exit__(self, *exc):
    os.environ.pop(BACKEND_ENV, None)
    if self.saved is not None:
      os.environ[BACKEND_ENV] = self.saved


def ternary_gemv_linear(x, leaves):
  """``quantized_linear(x, leaves, "ternary")`` with the CUDA-core GEMV forced (quantizer inside): x ``[M <= 4, K]``."""
  return dp4a_gemv.quantize_a8w2_gemv_kernel(x, leaves[inference.weights.KERNEL_PACKED],
                                             leaves[inference.weights.KERNEL_SCALE], inference.weights.BITNET_TOKENS)


def chain(fn):
  """``run(xs, ws) = [fn(x, w) for x, w in zip(xs, ws)]`` jitted: ``len(ws)`` distinct layers per call, so the
  device runs them back to back (no host dispatch between layers, as in a model) and the weights, together
  larger than L2, stream from HBM as they would in decode.

  Each layer's input is ordered after the layer before's output (``lax.optimization_barrier`` over the pair), as a
  model's data orders them. Without it the layers are independent, and XLA may fuse work of several into one
  kernel, which no decode does: it added all 8 layers' split-K partial sums of the W8A16 kernel in one fusion, and
  Llama 3 8B's down projection read 21.8 us a linear against 18.4 with an add per layer (one H200,
  benchmarks/results/w8a16_m1_rows_sweep_h200_48516ea.json; the order was added after that run)."""

  def run(xs, ws):
    outs = []
    for x, w in zip(xs, ws):
      if outs:
        x, _ = lax.optimization_barrier((x, outs[-1]))
      outs.append(fn(x, w))
    return outs

  return jax.jit(run)


def launched(stats: dict) -> dict:
  """:func:`time_runs`'s figures under ``launched_*`` names (host-timed, beside the device's)."""
  return {"launched_us": stats["us"], "launched_us_min": stats["us_min"], "launched_us_max": stats["us_max"],
          "launched_spread": stats["spread"], "iters": stats["iters"]}


def bench_linears(shapes, ms, variants, iters: int, runs: int, layers: int) -> list[dict]:
  """Per (K, N), M and variant: microseconds per linear on the device (:func:`gpu_times`: median, min, max of
  ``runs`` traced calls of a chain of ``layers`` distinct weights); the bandwidth reached and its share of the
  bf16 row's. ``launched_us`` (min, max): the same calls timed from the host, ``iters`` back to back a run."""
  rows = []
  for k, n in shapes:
    kw, kx = jax.random.split(jax.random.key(k * 31 + n))
    weights = {name: [] for name in ("bf16", *inference.SCHEMES)}
    convert = jax.jit(inference.quantize_weight, static_argnums=1)
    for i in range(layers):
      w = jax.random.normal(jax.random.fold_in(kw, i), (k, n), jnp.float32) / np.sqrt(k)
      weights["bf16"].append(w.astype(jnp.bfloat16))
      for scheme in inference.SCHEMES:
        weights[scheme].append(convert(w, scheme))
      del w
    mem = {name: inference.weight_bytes(v[0]) for name, v in weights.items()}
    for m in ms:
      xs = [jax.random.normal(jax.random.fold_in(kx, m * 1000 + i), (m, k), jnp.float32).astype(jnp.bfloat16)
            for i in range(layers)]
      base_us, base_gbps, xla_out = None, None, {}
      for variant in variants:
        scheme, backend = VARIANTS[variant]
        ws = weights[scheme or "bf16"]
        row = {"k": k, "n": n, "m": m, "variant": variant, "weight_mib": mem[scheme or "bf16"] / 2**20}
        try:
          fn = (lambda x, w: x @ w) if scheme is None else (lambda x, w, s=scheme: inference.quantized_linear(x, w, s))
          if backend == "gemv":
            if m > dp4a_gemv.MAX_M:
              continue
            fn, backend = ternary_gemv_linear, None
          with Backend(backend):
            compiled = chain(fn).lower(xs, ws).compile()
          out = compiled(xs, ws)[0]
          if scheme is not None:
            if scheme not in xla_out:
              with Backend("xla"):
                xla_out[scheme] = jax.jit(fn)(xs[0], ws[0])
            row["rel_err_vs_xla"] = rel_err(out, xla_out[scheme])
            row["ok"] = row["rel_err_vs_xla"] <= CHECK_REL_ERR[scheme]
          row.update(launched(time_runs(compiled, xs, ws, iters=iters, runs=runs, per_call=layers)))
          row.update(gpu_times(compiled, xs, ws, calls=runs, per_call=layers))
          us = row["us"]
          moved = mem[scheme or "bf16"] + ACTIVATION_BYTES * m * (k + n)
          row["gbps"] = moved / (us * 1e-6) / 1e9
          row["weight_gbps"] = mem[scheme or "bf16"] / (us * 1e-6) / 1e9
          if variant == "bf16":
            base_us, base_gbps = us, row["gbps"]
          if base_us:
            row["speedup"] = base_us / us
            row["pct_of_bf16_gbps"] = 100 * row["gbps"] / base_gbps
        except Exception as e:  # keep going: one failing variant must not lose the run
          row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
          traceback.print_exc()
        rows.append(row)
        print({k_: (round(v, 4) if isinstance(v, float) else v) for k_, v in row.items()}, flush=True)
  return rows


# Kernel tilings tried by --sweep at each --sweep-m (a tile takes 16 rows, those past M masked, so M <= 16 runs the
# same tiles; the dp4a GEMVs only M <= 4): (block_n, block_k, split_k[, num_warps]); split_k None = the automatic
# split, no num_warps = the shipped tiling's. block_k counts weight bytes (the a8w8 dp4a GEMV: int32 words of four).
SWEEP = {
    "w8a16": [(16, 512, 1), (32, 256, 1), (32, 512, 1), (64, 256, 1), (16, 256, None), (32, 256, None),
              (64, 256, None), (128, 128, None)],
    "a8w8": [(32, 256, 1), (32, 512, 1), (64, 256, 1), (64, 256, None), (128, 128, None)],
    "a8w2": [(16, 128, 1), (32, 128, 1), (64, 64, 1), (32, 64, None), (64, 128, None), (128, 64, None),
             (128, 32, None)],
    "ternary_gemv": [(32, 128, None), (16, 256, None), (8, 512, None), (16, 512, None), (32, 256, None),
                     (64, 64, None), (8, 1024, 1), (16, 256, 1)],
    "a8w8_gemv": [(8, 256, None), (8, 128, None), (8, 512, None), (4, 256, None), (16, 128, None), (16, 256, None),
                  (8, 256, None, 8), (8, 512, None, 8), (16, 256, None, 8)],
    # The same two GEMVs on float activations, quantized inside (the per-linear rows' path at M = 1).
    "quantize_ternary_gemv": [(16, 512, None), (8, 512, None), (8, 1024, None), (16, 1024, None), (16, 256, None),
                              (32, 256, None), (16, 512, None, 8), (8, 512, None, 8)],
    "quantize_a8w8_gemv": [(8, 512, None, 8), (8, 256, None, 8), (16, 256, None, 8), (16, 512, None, 8),
                           (8, 1024, None, 8), (8, 512, None, 4)],
}
DP4A_SWEEPS = ("ternary_gemv", "a8w8_gemv", "quantize_ternary_gemv", "quantize_a8w8_gemv")


def bench_kernel_sweep(shapes, iters: int, runs: int, layers: int, ms=(1,), kernels=None) -> list[dict]:
  """The Pallas kernels alone at each M in ``ms`` for each tiling in :data:`SWEEP` (chained like the linears);
  ``kernels`` picks some of its keys (None: all)."""
  kernels = [k for k in SWEEP if kernels is None or k in kernels]
  return [row for m in ms for row in _sweep_at(shapes, iters, runs, layers, m, kernels)]


def _sweep_at(shapes, iters: int, runs: int, layers: int, m: int, kernels) -> list[dict]:
  from pallas_kernels import int8_gemv, w8a16

  rows = []
  for k, n in shapes:
    key = jax.random.key(k + n)
    x = [jax.random.normal(jax.random.fold_in(key, i), (m, k)).astype(jnp.bfloat16) for i in range(layers)]
    xq = [jnp.ones((m, k), jnp.int8) for _ in range(layers)]
    sx = jnp.ones((m, 1), jnp.float32)
    wq = [jax.random.randint(jax.random.fold_in(key, 100 + i), (n, k), -127, 128, jnp.int32).astype(jnp.int8)
          for i in range(layers)]
    wp = [w[:, : k // 4] for w in wq]
    sw = jnp.ones((n,), jnp.float32)
    for kernel in kernels:
      if kernel in DP4A_SWEEPS and m > dp4a_gemv.MAX_M:
        continue
      for block_n, block_k, split, *warps in SWEEP[kernel]:
        row = {"k": k, "n": n, "m": m, "kernel": kernel, "block_n": block_n, "block_k": block_k}
        try:
          # Each kernel's shipped tiling, how it runs, its operands, its rows per tile and weight bytes per row; then
          # the sweep's block shape and split (None: the tiling's shipped rule, w8a16.SplitRule).
          if kernel == "ternary_gemv":
            config = dp4a_gemv.config_for(n, k // 4, m=m, codes=True)
            run = lambda a, w, c: dp4a_gemv.a8w2_gemv_kernel(a, sx, w, sw, config=c)  # noqa: E731
            args, block_m, k_bytes = (xq, wp), m, k // 4  # one program holds every row
          elif kernel == "a8w8_gemv":
            config = dp4a_gemv.config_for(n, k // 4, m=m, codes=True, packed=False)
            run = lambda a, w, c: dp4a_gemv.a8w8_gemv_kernel(a, sx, w, sw, config=c)  # noqa: E731
            args, block_m, k_bytes = (xq, wq), m, k // 4  # int32 words of four
          elif kernel in ("quantize_ternary_gemv", "quantize_a8w8_gemv"):
            packed = kernel == "quantize_ternary_gemv"
            config = dp4a_gemv.config_for(n, k // 4, m=m, packed=packed)
            call = dp4a_gemv.quantize_a8w2_gemv_kernel if packed else dp4a_gemv.quantize_a8w8_gemv_kernel
            spec = inference.weights.BITNET_TOKENS if packed else inference.weights.INT8_TOKENS
            run = lambda a, w, c, f=call, q=spec: f(a, w, sw, q, config=c)  # noqa: E731
            args, block_m, k_bytes = (x, wp if packed else wq), m, k // 4
          elif kernel == "w8a16":
            config = w8a16.config_for(m, n, k)
            run = lambda a, w, c: w8a16.w8a16_matmul_kernel(a, w, sw, config=c)  # noqa: E731
            args, block_m, k_bytes = (x, wq), config.block_m, k
          else:
            packed = kernel == "a8w2"
            k_bytes = k // 4 if packed else k
            config = int8_gemv.config_for(m, n, k_bytes, int8_gemv.A8W2_BASE if packed else int8_gemv.A8W8_BASE)
            call = int8_gemv.a8w2_matmul_kernel if packed else int8_gemv.a8w8_matmul_kernel
            run = lambda a, w, c, f=call: f(a, sx, w, sw, config=c)  # noqa: E731
            args, block_m = (xq, wp if packed else wq), config.block_m
          tiles = -(-m // block_m) * (n // block_n)
          split_k = config.split_rule.split_k(tiles, k_bytes, block_k) if split is None else split
          config = dataclasses.replace(config, block_n=block_n, block_k=block_k, split_k=split_k,
                                       num_warps=warps[0] if warps else config.num_warps)
          fn = chain(lambda a, w, c=config, r=run: r(a, w, c))
          nbytes = n * k if kernel in ("a8w8_gemv", "quantize_a8w8_gemv") else n * k_bytes
          row.update(split_k=config.split_k, num_warps=config.num_warps)
          compiled = fn.lower(*args).compile()
          row.update(launched(time_runs(compiled, *args, iters=iters, runs=runs, per_call=layers)))
          row.update(gpu_times(compiled, *args, calls=runs, per_call=layers))
          row["weight_gbps"] = nbytes / (row["us"] * 1e-6) / 1e9
        except Exception as e:
          row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(row, flush=True)
  return rows


def _decode_cases(schemes, batches, prompt_len, long_schemes, long_context, new_tokens):
  """``(scheme, kv_cache_dtype, batch, cache start)`` to time: every scheme and batch after a short prompt, then
  ``long_schemes`` with each KV cache dtype at a ``long_context`` cache."""
  from train.kv_cache import KV_CACHE_DTYPES

  cases = [(scheme, "auto", b, prompt_len) for scheme in schemes for b in batches]
  if long_context:
    cases += [(scheme, kv, b, long_context - new_tokens) for scheme in long_schemes for kv in KV_CACHE_DTYPES
              for b in batches]
  return cases


def bench_decode(config_files, schemes, batches, prompt_len: int, new_tokens: int, runs: int, long_schemes=(),
                 long_context: int = 0, scan_layers: bool = False, profile: bool = False,
                 on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
  """Decode ms/token and tokens/s (median, min, max of ``runs``) per (scheme, KV cache dtype, batch, context).

  Short-context rows prefill a ``prompt_len`` random prompt (``train.generate``'s prefill); long-context rows
  start from a zero cache whose index says ``long_context - new_tokens`` tokens are in it: a step's attention
  reads all S cached positions whatever they hold, so the time is that of a real cache, without a 2k-token
  prefill to compile and run per row. ``profile`` adds each row's kernel time per token by category
  (:func:`profile_decode`). ``on_row(rows)`` is called with the rows so far after each one (``main`` saves them,
  so a call cut by its time limit keeps what it measured).
  """
  from train import config as train_config
  from train import kv_cache
  from train.generate import init_cache, make_generator, prepare
  from train.model import Transformer

  cases = _decode_cases(schemes, batches, prompt_len, long_schemes, long_context, new_tokens)
  rows = []
  for scheme in dict.fromkeys(case[0] for case in cases):  # each scheme's weights built and converted once
    path = config_files[1] if scheme == "ternary" else config_files[0]
    mine = [case for case in cases if case[0] == scheme]
    try:
      model_config = train_config.model_config(train_config.load_file(path))
      master = jax.jit(Transformer(model_config).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
      prepared = {kv: prepare(model_config, master, scheme, scan_layers=scan_layers, kv_cache_dtype=kv)
                  for kv in dict.fromkeys(case[1] for case in mine)}
      del master
    except Exception as e:
      traceback.print_exc()
      rows += [{"config": path, "scheme": scheme, "error": f"{type(e).__name__}: {str(e)[:300]}"}]
      continue
    for _, kv, batch, start_len in mine:
      long = start_len != prompt_len or kv != "auto"
      row = {"config": path, "scheme": scheme, "kv_cache": kv, "batch": batch, "context": start_len + new_tokens,
             "prefill": not long, "new_tokens": new_tokens, "scan_layers": scan_layers}
      try:
        model, params = prepared[kv]
        row["params_gib"] = inference.weight_bytes(params) / 2**30
        gen = make_generator(model, new_tokens)
        key = jax.random.key(2)
        max_len = start_len + new_tokens
        prompt = jax.random.randint(jax.random.key(1), (batch, start_len), 0, model_config.vocab_size)

        def fresh_cache():
          cache = init_cache(model, batch, max_len)
          return {**cache, "index": jnp.full((), start_len, jnp.int32)} if long else cache

        cache = fresh_cache()
        row["cache_mib"] = inference.weight_bytes(cache) / 2**20
        start = time.perf_counter()
        prefill = None if long else gen.prefill.lower(params, cache, prompt, key).compile()
        lowered = gen.decode.lower(params, cache, jax.ShapeDtypeStruct((batch,), jnp.int32), key)
        decode = lowered.compile()
        row["compile_s"] = time.perf_counter() - start
        row["cache_copies"] = len(kv_cache.cache_copies(decode.as_text(), cache))
        # Which step ran: a hash of the lowered program (every kernel's tiling and launch parameters are in it), not
        # of the compiled one, whose text differs when it comes from a persistent compilation cache.
        row["program_sha1"] = hashlib.sha1(lowered.as_text().encode()).hexdigest()[:16]

        def decode_inputs():
          cache = fresh_cache()
          token = jnp.zeros((batch,), jnp.int32)
          if prefill is not None:
            cache, token = prefill(params, cache, prompt, key)
          return jax.block_until_ready((params, cache, token, key))

        samples = []
        for _ in range(runs + 1):  # the first run warms up
          inputs = decode_inputs()
          start = time.perf_counter()
          jax.block_until_ready(decode(*inputs))
          samples.append((time.perf_counter() - start) * 1e3 / (new_tokens - 1))
        samples = samples[1:]
        median = float(np.median(samples))
        row.update(ms_per_token=median, ms_min=min(samples), ms_max=max(samples), runs=runs,
                   spread=(max(samples) - min(samples)) / median, tokens_per_s=batch * 1e3 / median)
        row["unstable"] = row["spread"] > UNSTABLE_SPREAD
        if profile:
          row.update(profile_decode(lowered, decode_inputs, batch, new_tokens - 1))
      except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
      rows.append(row)
      print({k_: v for k_, v in row.items() if k_ != "profile_top_kernels"}, flush=True)
      if on_row is not None:
        on_row(rows)
    del prepared
  for r in rows:  # against bf16 weights with the bf16 cache at the same batch and context
    base = next((b.get("tokens_per_s") for b in rows if b.get("scheme") == "bf16" and b.get("kv_cache") == "auto"
                 and (b.get("batch"), b.get("context")) == (r.get("batch"), r.get("context"))), None)
    if base and r.get("tokens_per_s"):
      r["speedup"] = r["tokens_per_s"] / base
  return rows


def profile_decode(lowered, make_inputs, batch: int, tokens: int, calls: int = PROFILE_CALLS) -> dict:
  """Kernel microseconds per generated token by category (``benchmarks.profile_step``) and the top kernels of the
  median of ``calls`` traced calls (by kernel time; one ``decode(*make_inputs())`` call of ``tokens`` tokens a
  trace), with the kernel time's min, max and spread, and each call's idle time. The ``lowered`` step is compiled
  here again without CUDA graphs (``profile_step.GRAPHLESS``), so that the trace names each kernel's HLO op; the
  time between its kernels (``idle``) is then the host's launching."""
  from benchmarks import profile_step

  if calls % 2 == 0:
    raise ValueError(f"profile_decode: calls must be odd (the median call's profile is kept), got {calls}")
  decode = lowered.compile(compiler_options=profile_step.GRAPHLESS)
  hlo = decode.as_text()
  op_names, shapes = profile_step.hlo_op_names(hlo), profile_step.hlo_output_shapes(hlo)
  jax.block_until_ready(decode(*make_inputs()))  # untraced: the first call's launches pay for loading the kernels
  splits = []
  for _ in range(calls):
    inputs = make_inputs()
    kernels = profile_step.traced_kernels(lambda: jax.block_until_ready(decode(*inputs)))
    splits.append(profile_step.breakdown(kernels, op_names, shapes, (batch,), tokens))
  kernel_us = [1e3 * split["kernel_ms_per_step"] for split in splits]
  median = splits[int(np.argsort(kernel_us)[len(splits) // 2])]
  stats = sample_stats(kernel_us)
  return {"profile_us_per_token": {c: 1e3 * ms for c, ms in median["ms_per_step"].items()},
          "profile_kernel_us_per_token": stats["us"], "profile_kernel_us_min": stats["us_min"],
          "profile_kernel_us_max": stats["us_max"], "profile_kernel_spread": stats["spread"],
          "profile_unstable": stats["unstable"],
          "profile_idle_us_per_token": [1e3 * split["ms_per_step"]["idle"] for split in splits],
          "profile_calls": calls,
          "profile_top_kernels": [{"category": k["category"], "kernel": k["kernel"], "hlo": k["hlo"],
                                   "us_per_token": 1e3 * k["ms_per_step"]}
                                  for k in median["top_kernels"][:TOP_DECODE_KERNELS]]}


def summary(rows: list[dict]) -> list[dict]:
  """Per shape and M: speed-up over bf16 of each default-dispatch scheme, and the targets met."""
  out = []
  for (k, n) in sorted({(r["k"], r["n"]) for r in rows}):
    for m in sorted({r["m"] for r in rows if (r["k"], r["n"]) == (k, n)}):
      cell = {"k": k, "n": n, "m": m}
      for r in rows:
        if (r["k"], r["n"], r["m"]) == (k, n, m) and "us" in r:
          cell[f"{r['variant']}_us"] = r["us"]
          cell[f"{r['variant']}_gbps"] = r.get("gbps")
          if r["variant"] in ("w8a16", "w8a8", "ternary"):
            cell[f"{r['variant']}_x"] = r.get("speedup")
            cell[f"{r['variant']}_pct"] = r.get("pct_of_bf16_gbps")
      for scheme in TARGETS:
        target = target_for(scheme, m)
        if target is not None and cell.get(f"{scheme}_x") is not None:
          cell.setdefault("targets", []).append(f"{scheme}{'>=' if cell[f'{scheme}_x'] >= target else '<'}{target}")
      if "targets" in cell:
        cell["targets"] = " ".join(cell["targets"])
      out.append(cell)
  return out


def plot(rows: list[dict], path: str) -> str | None:
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  shapes = sorted({(r["k"], r["n"]) for r in rows})
  if not shapes:  # decode or sweep only
    return None
  fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
  for ax, (k, n) in zip(axes[0], shapes):
    for variant in VARIANTS:
      pts = sorted((r["m"], r["speedup"]) for r in rows if (r["k"], r["n"]) == (k, n) and r["variant"] == variant
                   and r.get("speedup"))
      if pts and variant != "bf16":
        ax.plot(*zip(*pts), marker="o", label=variant, linestyle="-" if "_" not in variant else ":")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("M (tokens)")
    ax.set_ylabel("speed-up over bf16")
    ax.set_title(f"linear K={k} -> N={n}")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return path


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shapes", nargs="*", default=[f"{k},{n}" for k, n in SHAPES], help="K,N")
  parser.add_argument("--m", type=int, nargs="*", default=list(MS))
  parser.add_argument("--variants", nargs="*", default=["bf16", *inference.SCHEMES, "ternary_gemv"],
                      choices=list(VARIANTS))
  parser.add_argument("--iters", type=int, default=10, help="back-to-back calls per timed run")
  parser.add_argument("--runs", type=int, default=MIN_RUNS, help=f"timed runs per figure (>= {MIN_RUNS})")
  parser.add_argument("--layers", type=int, default=8, help="distinct weights chained in one call (> L2 in total)")
  parser.add_argument("--sweep", action="store_true", help="also time the kernels' tilings (at --sweep-m)")
  parser.add_argument("--sweep-m", type=int, nargs="+", default=[1], help="the M values of --sweep")
  parser.add_argument("--sweep-kernels", nargs="+", choices=sorted(SWEEP), default=None,
                      help="the kernels of --sweep (default: all)")
  parser.add_argument("--decode-scan", action="store_true", help="decode with nn.scan over layers (default: unrolled)")
  parser.add_argument("--profile-decode", action="store_true",
                      help="each decode row's kernel time per token by category (traced calls without CUDA graphs)")
  parser.add_argument("--xla-decode-ops", action="store_true",
                      help="decode's norms and attention step by XLA, not pallas_kernels.decode (for A/B runs)")
  parser.add_argument("--early-launch", action=argparse.BooleanOptionalAction, default=None,
                      help="kernels with / without the PDL early-launch trigger (policy.PDL_EARLY_LAUNCH; default: "
                           "the policy's)")
  parser.add_argument("--gated-epilogue", action=argparse.BooleanOptionalAction, default=None,
                      help="decode's gate_up GEMV writes act(gate) * up / [gate | up] (policy.GATED_EPILOGUE; "
                           "default: the policy's)")
  parser.add_argument("--decode-config", default="1b", choices=list(DECODE_CONFIGS))
  parser.add_argument("--decode-schemes", nargs="*", default=["bf16", *inference.SCHEMES])
  parser.add_argument("--decode-batches", type=int, nargs="*", default=[1, 8])
  parser.add_argument("--prompt-len", type=int, default=16)
  parser.add_argument("--new-tokens", type=int, default=65, help="decode steps + 1 (the first token is the prefill's)")
  parser.add_argument("--long-context", type=int, default=2048, help="cache length of the KV-cache rows (0: none)")
  parser.add_argument("--long-schemes", nargs="*", default=["bf16", "ternary"])
  parser.add_argument("--skip-decode", action="store_true")
  parser.add_argument("--smoke", action="store_true", help=f"CPU check that everything runs: tiny shapes ({SMOKE})")
  parser.add_argument("--out")
  args = parser.parse_args(argv)
  if args.smoke:
    for name, value in SMOKE.items():
      setattr(args, name, value)
  if args.xla_decode_ops:
    policy.DECODE_NORM_KERNEL = policy.DECODE_ATTENTION_KERNEL = False
  if args.early_launch is not None:
    policy.PDL_EARLY_LAUNCH = args.early_launch
  if args.gated_epilogue is not None:
    policy.GATED_EPILOGUE = args.gated_epilogue
  if args.runs < MIN_RUNS:
    parser.error(f"--runs {args.runs}: every figure is the median of at least {MIN_RUNS} runs")
  if "bf16" not in args.variants:
    args.variants.insert(0, "bf16")  # every speed-up is against it
  if jax.default_backend() != "gpu":  # forced Pallas GPU kernels run on a GPU only
    args.variants = [v for v in args.variants if VARIANTS[v][1] not in ("pallas", "gemv")]

  shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes]
  start = time.perf_counter()
  linear_rows = bench_linears(shapes, args.m, args.variants, args.iters, args.runs, args.layers)
  sweep_rows = (bench_kernel_sweep(shapes, args.iters, args.runs, args.layers, args.sweep_m, args.sweep_kernels)
                if args.sweep else [])
  def save_partial(decode_rows: list[dict]) -> None:  # what is measured so far, kept if a later row runs out of time
    write_json("inference", linear_rows, args.out, sweep=sweep_rows, decode=decode_rows, partial=True)

  save_partial([])
  decode_rows = []
  if not args.skip_decode:
    decode_rows = bench_decode(DECODE_CONFIGS[args.decode_config], args.decode_schemes, args.decode_batches,
                               args.prompt_len, args.new_tokens, args.runs, args.long_schemes, args.long_context,
                               args.decode_scan, args.profile_decode, on_row=save_partial)
  memory = [{"k": k, "n": n, **{s: r["weight_mib"] for s in ("bf16", *inference.SCHEMES)
                                for r in linear_rows if (r["k"], r["n"]) == (k, n) and r["variant"] == s}}
            for k, n in shapes]
  cells = summary(linear_rows)
  path = write_json("inference", linear_rows, args.out, decode=decode_rows, memory=memory, summary=cells,
                    sweep=sweep_rows, seconds=time.perf_counter() - start)
  png = plot(linear_rows, os.path.splitext(path)[0] + ".png")

  failed = [r for r in linear_rows if "error" in r or r.get("ok") is False]
  unstable = [r for r in linear_rows + decode_rows if r.get("unstable") or r.get("profile_unstable")]
  print("\nweight memory of one linear (MiB):")
  print(table(memory, ["k", "n", "bf16", "w8a16", "w8a8", "ternary"]))
  if sweep_rows:
    print("\nkernel tilings:")
    print(table(sweep_rows, ["k", "n", "m", "kernel", "block_n", "block_k", "split_k", "us", "weight_gbps", "error"]))
  print(f"\nper linear on the device (median of {args.runs} traced calls, min, max; GB/s = (weight + activation bytes)"
        " / time; launched_us: timed from the host):")
  print(table(linear_rows, ["k", "n", "m", "variant", "us", "us_min", "us_max", "gbps", "pct_of_bf16_gbps", "speedup",
                            "launched_us", "unstable", "error"]))
  if decode_rows:
    print("\ndecode (random weights; speedup against bf16 weights and cache at the same batch and context):")
    print(table(decode_rows, ["scheme", "kv_cache", "batch", "context", "params_gib", "cache_mib", "ms_per_token",
                              "ms_min", "ms_max", "tokens_per_s", "speedup", "cache_copies", "compile_s", "unstable",
                              "error"]))
  profiled = [{"scheme": r["scheme"], "kv_cache": r["kv_cache"], "batch": r["batch"], "context": r["context"],
               "ms_per_token": r["ms_per_token"], "kernels_us": r["profile_kernel_us_per_token"],
               "kernels_spread": r["profile_kernel_spread"], **r["profile_us_per_token"]}
              for r in decode_rows if "profile_us_per_token" in r]
  if profiled:
    from benchmarks.profile_step import CATEGORIES

    print(f"\ndecode kernel time per token by category (us, median of {PROFILE_CALLS} traced calls of the step compiled"
          " without CUDA graphs; idle: the host's launching; ms_per_token: the timed runs, graphs on):")
    print(table(profiled, ["scheme", "kv_cache", "batch", "context", "ms_per_token", "kernels_us", "kernels_spread",
                           *(c for c in CATEGORIES if any(p[c] for p in profiled))]))
  if failed:
    print(f"\n{len(failed)} linear rows failed or disagreed with XLA:")
    print(table(failed, ["k", "n", "m", "variant", "rel_err_vs_xla", "error"]))
  if unstable:
    print(f"\n{len(unstable)} figures spread over {UNSTABLE_SPREAD:.0%} between runs (issue 28: a bug to find)")
  print("\nspeed-up over bf16 and % of the bf16 row's bandwidth (default dispatch):")
  print(table(cells, ["k", "n", "m", "bf16_us", "bf16_gbps", "w8a16_x", "w8a16_pct", "w8a8_x", "w8a8_pct",
                      "ternary_x", "ternary_pct", "ternary_gemv_us", "targets"]))
  print(f"\nwrote {path}" + (f" and {png}" if png else "") + f" in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
