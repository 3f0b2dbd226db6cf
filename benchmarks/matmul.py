"""GEMM and quantization benchmarks: XLA bf16, XLA reference paths, and our Pallas kernels.

    PYTHONPATH=. python benchmarks/matmul.py                  # 8192^3, every variant
    PYTHONPATH=. python benchmarks/matmul.py --sizes 1024 2048 4096 8192 16384
    PYTHONPATH=. python benchmarks/matmul.py --tune 8192 8192 8192
    PYTHONPATH=. python benchmarks/matmul.py --quantize

Prints a table last and writes JSON to benchmarks/results/ (or ``--out``). TOP/s counts
2*M*N*K operations. Every Pallas result is checked against the reference before timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table, time_ms, write_json  # noqa: E402
from jaxlowbit_numerics.formats import QuantSpec  # noqa: E402
from pallas_kernels import hopper_gemm, tuning, quantize as qkernels  # noqa: E402
from pallas_kernels.reference import (  # noqa: E402
    quantize_cols_t_reference,
    quantize_rows_reference,
    scaled_matmul_reference,
)

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _operands(m, n, k, seed=0):
  ka, kb, ks, kt = jax.random.split(jax.random.key(seed), 4)
  a16 = jax.random.normal(ka, (m, k), jnp.bfloat16)
  b16 = jax.random.normal(kb, (n, k), jnp.bfloat16)
  a8 = jax.random.randint(ka, (m, k), -127, 128, jnp.int32).astype(jnp.int8)
  b8 = jax.random.randint(kb, (n, k), -127, 128, jnp.int32).astype(jnp.int8)
  sa = jax.random.uniform(ks, (m,), minval=0.5, maxval=1.5) / 127
  sb = jax.random.uniform(kt, (n,), minval=0.5, maxval=1.5) / 127
  return a16, b16, a8, b8, sa, sb


def _xla_fp8_dot_scalar_scales(a, sa, b, sb):
  # FP8 dot straight to bf16 with the two scalar scales folded into one multiply.
  out = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)
  return (out * (sa * sb).astype(jnp.bfloat16)).astype(jnp.bfloat16)


def _xla_fp8_tensorwise(a, sa, b, sb):
  # The dequantize-then-dot pattern XLA rewrites into one cuBLASLt FP8 GEMM with scalar scales.
  return jax.lax.dot_general(
      a.astype(jnp.bfloat16) * sa.astype(jnp.bfloat16), b.astype(jnp.bfloat16) * sb.astype(jnp.bfloat16),
      (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16,
  )


def gemm_variants(m, n, k, config=None):
  """name -> (jitted fn, args, reference fn or None) for one problem size."""
  a16, b16, a8, b8, sa, sb = _operands(m, n, k)
  f8a, f8b = a16.astype(E4M3), b16.astype(E4M3)
  f8g = b16.astype(E5M2)
  one = jnp.ones((), jnp.float32)
  ref = functools.partial(scaled_matmul_reference, out_dtype=jnp.bfloat16)
  def pallas(a, sa, b, sb):  # the tuned config of each problem unless one is given
    chosen = config or tuning.config_for(a.shape[0], b.shape[0], a.shape[1], a.dtype)
    return hopper_gemm.scaled_matmul_hopper(a, sa, b, sb, out_dtype=jnp.bfloat16, config=chosen)

  return {
      "xla_bf16": (jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())))), (a16, b16), None),
      "xla_int8_rowcol": (jax.jit(ref), (a8, sa, b8, sb), None),
      "pallas_int8_rowcol": (jax.jit(pallas), (a8, sa, b8, sb), ref),
      "xla_fp8_rowwise": (jax.jit(ref), (f8a, sa, f8b, sb), None),
      "pallas_fp8_rowwise": (jax.jit(pallas), (f8a, sa, f8b, sb), ref),
      "xla_fp8_tensorwise_dequant_dot": (jax.jit(_xla_fp8_tensorwise), (f8a, one * 0.5, f8b, one * 2.0), None),
      "xla_fp8_tensorwise_dot": (jax.jit(_xla_fp8_dot_scalar_scales), (f8a, one * 0.5, f8b, one * 2.0), None),
      "xla_fp8_tensorwise_ref": (jax.jit(ref), (f8a, one * 0.5, f8b, one * 2.0), None),
      "pallas_fp8_tensorwise": (jax.jit(pallas), (f8a, one * 0.5, f8b, one * 2.0), ref),
      "pallas_fp8_e4m3_e5m2": (jax.jit(pallas), (f8a, sa, f8g, sb), ref),
  }


def _check(name, fn, args, ref):
  out = np.asarray(fn(*args), np.float32)
  expect = np.asarray(ref(*args), np.float32)
  err = float(np.linalg.norm(out - expect) / np.linalg.norm(expect))
  # bf16 output: each element is rounded once (rel 2**-9); int8 sums are exact before that.
  if not np.isfinite(err) or err > 4e-3:
    raise AssertionError(f"{name}: relative error {err:.2e} against the reference")
  return err


def bench_gemm(sizes, only=None):
  rows = []
  for m, n, k in sizes:
    variants = gemm_variants(m, n, k)
    for name, (fn, args, ref) in variants.items():
      if only and not any(o in name for o in only):
        continue
      row = {"name": name, "m": m, "n": n, "k": k}
      try:
        if ref is not None:
          row["rel_err"] = _check(name, fn, args, ref)
        ms = time_ms(fn, *args)
        row.update(ms=ms, tops=2 * m * n * k / ms / 1e9)
      except Exception as e:  # keep the other variants' numbers
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
      rows.append(row)
      print(row, flush=True)
  return rows


def tune(m, n, k, dtype="int8"):
  """Sweep GemmConfigs for one shape; print the best first."""
  a16, b16, a8, b8, sa, sb = _operands(m, n, k)
  a, b = (a8, b8) if dtype == "int8" else (a16.astype(E4M3), b16.astype(E4M3))
  ref = functools.partial(scaled_matmul_reference, out_dtype=jnp.bfloat16)
  rows = []
  space = itertools.product(
      [(128, 128, hopper_gemm.Dim.N), (128, 128, hopper_gemm.Dim.M)],
      [2, 3], [hopper_gemm.Dim.N, hopper_gemm.Dim.M], [8], [0, 1],
  )
  for (tm, tn, wgd), stages, minor, width, in_flight in space:
    cfg = hopper_gemm.GemmConfig(tile_m=tm, tile_n=tn, stages=stages, grid_minor_dim=minor,
                                 grid_tile_width=width, wg_dimension=wgd, wgmma_in_flight=in_flight)
    fn = jax.jit(functools.partial(hopper_gemm.scaled_matmul_hopper, out_dtype=jnp.bfloat16, config=cfg))
    row = {"dtype": dtype, "m": m, "n": n, "k": k, **{f: str(v) for f, v in dataclasses.asdict(cfg).items()}}
    try:
      row["rel_err"] = _check("tune", fn, (a, sa, b, sb), ref)
      ms = time_ms(fn, a, sa, b, sb)
      row.update(ms=ms, tops=2 * m * n * k / ms / 1e9)
    except Exception as e:
      row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
    rows.append(row)
  rows.sort(key=lambda r: -r.get("tops", 0))
  return rows


def bench_quantize(m=16384, k=8192):
  """Quantize kernels against XLA and against the device's copy bandwidth (bytes read + written)."""
  x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
  rows = []
  copy = jax.jit(lambda x: x * 2)
  ms = time_ms(copy, x)
  copy_gbs = 2 * x.size * 2 / ms / 1e6
  rows.append({"name": "copy (x*2, bf16)", "ms": ms, "gb_s": copy_gbs, "of_copy": 1.0})
  for spec in (QuantSpec("int8"), QuantSpec("float8_e4m3fn", power_of_two=True)):
    out_bytes = jnp.dtype(spec.dtype).itemsize
    cases = {
        "rows": (quantize_rows_reference, qkernels.quantize_rows_kernel, x.size * (2 + out_bytes)),
        "cols_t": (quantize_cols_t_reference, qkernels.quantize_cols_t_kernel, x.size * (2 + out_bytes)),
        "rows+cols_t": (
            lambda x, spec: (quantize_rows_reference(x, spec), quantize_cols_t_reference(x, spec)),
            qkernels.quantize_rows_and_cols_t_kernel,
            x.size * (2 + 2 * out_bytes),  # ideal: one read, two writes
        ),
    }
    for what, (ref_fn, kernel_fn, ideal_bytes) in cases.items():
      for impl, fn in (("xla", ref_fn), ("pallas", kernel_fn)):
        row = {"name": f"{impl} {spec.dtype} {what}"}
        try:
          jfn = jax.jit(functools.partial(fn, spec=spec))
          if impl == "pallas":
            got, want = jfn(x), jax.jit(functools.partial(ref_fn, spec=spec))(x)
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
              g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
              row["mismatch"] = max(row.get("mismatch", 0.0), float(np.mean(g != w)))
          ms = time_ms(jfn, x)
          gbs = ideal_bytes / ms / 1e6
          row.update(ms=ms, gb_s=gbs, of_copy=gbs / copy_gbs)
        except Exception as e:
          row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(row, flush=True)
  return rows


def bench_fused(m=16384, d=2048, h=8192):
  """Fused RMSNorm / SwiGLU quantizers against the op in XLA followed by the quantize kernels (1B shapes).

  Ideal bytes: the inputs read once, the quantized outputs written once (the fused kernels read
  the inputs twice when a per-column copy is written: its scales need every row first).
  """
  kx, kg, kh = jax.random.split(jax.random.key(2), 3)
  x = jax.random.normal(kx, (m, d), jnp.bfloat16)
  gamma = 1 + 0.1 * jax.random.normal(kg, (d,), jnp.float32)
  gate_up = jax.random.normal(kh, (m, 2 * h), jnp.bfloat16)
  copy_ms = time_ms(jax.jit(lambda x: x * 2), gate_up)
  copy_gbs = 2 * gate_up.size * 2 / copy_ms / 1e6
  rows = [{"name": "copy (x*2, bf16)", "ms": copy_ms, "gb_s": copy_gbs, "of_copy": 1.0}]
  specs = {"int8": (QuantSpec("int8"), QuantSpec("int8"), False),
           "fp8_rowwise": (QuantSpec("float8_e4m3fn", power_of_two=True),) * 2 + (False,),
           "fp8_tensorwise": (QuantSpec("float8_e4m3fn", per_tensor=True),) * 2 + (False,),
           "bitnet": (QuantSpec("int8", eps=1e-5), None, True)}
  ops = {"rmsnorm": ((x, gamma), qkernels.RmsNorm(1e-5, jnp.dtype(jnp.bfloat16)), m * d),
         "swiglu": ((gate_up,), qkernels.SwiGLU(), m * h)}
  for op_name, (inputs, prologue, out_elems) in ops.items():
    in_bytes = sum(a.size * a.dtype.itemsize for a in inputs)
    for spec_name, (rows_spec, cols_spec, rows_t) in specs.items():
      ideal = in_bytes + 2 * out_elems  # two 8-bit layouts
      fused = jax.jit(lambda *a, p=prologue, r=rows_spec, c=cols_spec, t=rows_t: qkernels.fused_quantize_kernel(
          a, p, r, c, t))
      unfused = jax.jit(lambda *a, p=prologue, r=rows_spec, c=cols_spec, t=rows_t: qkernels.fused_quantize_kernel(
          (p.reference(a),), qkernels.Identity(), r, c, t))
      reference = jax.jit(lambda *a, p=prologue, r=rows_spec, c=cols_spec, t=rows_t: qkernels.fused_quantize_reference(
          a, p, r, c, t))
      for impl, fn in (("fused", fused), ("xla op + kernel", unfused), ("xla", reference)):
        row = {"name": f"{op_name} {spec_name} {impl}"}
        try:
          if impl == "fused":
            got, want = fn(*inputs), reference(*inputs)
            row["mismatch"] = max(float(np.mean(np.asarray(g, np.float32) != np.asarray(w, np.float32)))
                                  for g, w in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want[:2])))
          ms = time_ms(fn, *inputs)
          row.update(ms=ms, gb_s=ideal / ms / 1e6, of_copy=ideal / ms / 1e6 / copy_gbs)
        except Exception as e:
          row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(row, flush=True)
  return rows


def tune_fused(m=16384):
  """Sweep the fused quantizers' block shapes per prologue at 1B shapes (rows + transposed int8 / fp8)."""
  kx, kg = jax.random.split(jax.random.key(3))
  cases = {
      "Identity2048": ((jax.random.normal(kx, (m, 2048), jnp.bfloat16),), qkernels.Identity()),
      "Identity8192": ((jax.random.normal(kx, (m, 8192), jnp.bfloat16),), qkernels.Identity()),
      "RmsNorm2048": ((jax.random.normal(kx, (m, 2048), jnp.bfloat16), 1 + jax.random.normal(kg, (2048,)) / 10),
                      qkernels.RmsNorm(1e-5, jnp.dtype(jnp.bfloat16))),
      "SwiGLU8192": ((jax.random.normal(kx, (m, 16384), jnp.bfloat16),), qkernels.SwiGLU()),
  }
  rows = []
  for spec in (QuantSpec("int8"), QuantSpec("float8_e4m3fn", power_of_two=True)):
    kind = "int8" if spec.is_int8 else "fp8"
    for name, (inputs, prologue) in cases.items():
      key = (kind, type(prologue).__name__)
      saved_rows, saved_tile = dict(tuning.QUANTIZE_ROWS_BY_PROLOGUE), dict(tuning.QUANTIZE_TILE)
      width = prologue.width(inputs)
      for block, chunk, warps in itertools.product([4, 8, 16], sorted({2048, min(width, 4096)}), [4, 8]):
        tuning.QUANTIZE_ROWS_BY_PROLOGUE[key] = (block, chunk, warps)
        rows.append(_time_fused(f"{name} {kind} rows", inputs, prologue, spec, block=block, chunk=chunk, warps=warps))
      best = min((r for r in rows if r.get("op") == f"{name} {kind} rows" and "ms" in r), key=lambda r: r["ms"])
      tuning.QUANTIZE_ROWS_BY_PROLOGUE[key] = (best["block"], best["chunk"], best["warps"])
      for tile_r, tile_c, warps in [(64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (64, 128, 8), (32, 128, 4)]:
        tuning.QUANTIZE_TILE[type(prologue).__name__] = (tile_r, tile_c, warps)
        rows.append(_time_fused(f"{name} {kind} tile", inputs, prologue, spec, tile=(tile_r, tile_c), warps=warps))
      tuning.QUANTIZE_ROWS_BY_PROLOGUE.clear(), tuning.QUANTIZE_ROWS_BY_PROLOGUE.update(saved_rows)
      tuning.QUANTIZE_TILE.clear(), tuning.QUANTIZE_TILE.update(saved_tile)
  return rows


def _time_fused(op, inputs, prologue, spec, **config):
  row = {"op": op, **config}
  try:
    fn = jax.jit(lambda *a: qkernels.fused_quantize_kernel(a, prologue, spec, spec))
    row["ms"] = time_ms(fn, *inputs, iters=5, reps=3)
  except Exception as e:
    row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
  print(row, flush=True)
  return row


def bench_swiglu_grad(m=16384, h=8192):
  """SwiGLU's backward at 1B shapes (``dh [m, h]``, ``gate_up [m, 2h]`` -> ``d gate_up``): XLA's
  concatenate fusion against the values kernel per tile shape; ideal bytes: inputs read once, output
  written once. Each kernel variant is checked against the reference (fraction of values that differ)."""
  kd, kg = jax.random.split(jax.random.key(5))
  inputs = (jax.random.normal(kd, (m, h), jnp.bfloat16), jax.random.normal(kg, (m, 2 * h), jnp.bfloat16))
  prologue = qkernels.SwiGLUGrad()
  ideal = sum(a.size * a.dtype.itemsize for a in inputs) + inputs[1].size * 2
  want = jax.jit(prologue.reference)(inputs)
  rows = [{"name": "xla concatenate fusion", "ms": time_ms(jax.jit(prologue.reference), inputs, iters=5, reps=3)}]
  saved = dict(tuning.PROLOGUE_TILE)
  try:
    for tile in ((32, 128, 4), (64, 128, 4), (32, 256, 4), (64, 256, 8), (16, 256, 4), (128, 64, 4), (64, 64, 4)):
      tuning.PROLOGUE_TILE["SwiGLUGrad"] = tile
      fn = jax.jit(lambda a: qkernels.prologue_kernel(a, prologue))
      row = {"name": f"values kernel {tile}", "tile": tile}
      try:
        row["mismatch"] = float(np.mean(np.asarray(fn(inputs), np.float32) != np.asarray(want, np.float32)))
        row["ms"] = time_ms(fn, inputs, iters=5, reps=3)
      except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
      print(row, flush=True)
      rows.append(row)
  finally:
    tuning.PROLOGUE_TILE.clear()
    tuning.PROLOGUE_TILE.update(saved)
  for row in rows:
    if "ms" in row:
      row["gb_s"] = ideal / row["ms"] / 1e6
  return rows


def bench_column_scales(m=16384, sweep=True):
  """Rows + transposed quantization at 1B shapes: per-column scales from the rows kernel's partials
  ("rows") against the tiled statistics pass ("tiles"), per prologue; then the tiled passes' tile shapes.

  Ideal bytes: the inputs read once, both 8-bit layouts written once. Every variant is checked
  against the XLA reference first (fraction of codes that differ: rounding ties only).
  """
  kx, kg = jax.random.split(jax.random.key(4))
  gamma = 1 + 0.1 * jax.random.normal(kg, (2048,), jnp.float32)
  cases = {
      "identity 16384x2048 (attn out x, down g)": ((jax.random.normal(kx, (m, 2048), jnp.bfloat16),), qkernels.Identity()),
      "identity 16384x3072 (qkv g)": ((jax.random.normal(kx, (m, 3072), jnp.bfloat16),), qkernels.Identity()),
      "identity 16384x16384 (gate_up g)": ((jax.random.normal(kx, (m, 16384), jnp.bfloat16),), qkernels.Identity()),
      "rmsnorm 16384x2048": ((jax.random.normal(kx, (m, 2048), jnp.bfloat16), gamma),
                             qkernels.RmsNorm(1e-5, jnp.dtype(jnp.bfloat16))),
      "swiglu 16384x16384->8192": ((jax.random.normal(kx, (m, 16384), jnp.bfloat16),), qkernels.SwiGLU()),
  }
  specs = {"int8": QuantSpec("int8"), "fp8_rowwise": QuantSpec("float8_e4m3fn", power_of_two=True)}
  copy = jax.random.normal(kx, (m, 16384), jnp.bfloat16)
  copy_gbs = 2 * copy.size * 2 / time_ms(jax.jit(lambda x: x * 2), copy) / 1e6
  rows = [{"name": "copy (x*2, bf16)", "gb_s": copy_gbs, "of_copy": 1.0}]
  saved = (tuning.QUANTIZE_STATS_FROM_TILES, dict(tuning.QUANTIZE_STATS_TILE), dict(tuning.QUANTIZE_TILE))

  def run(name, inputs, prologue, spec, **extra):
    row = {"name": name, **extra}
    try:
      fn = jax.jit(lambda *a: qkernels.fused_quantize_kernel(a, prologue, spec, spec))
      got, want = fn(*inputs), qkernels.fused_quantize_reference(inputs, prologue, spec, spec)
      row["mismatch"] = max(float(np.mean(np.asarray(g, np.float32) != np.asarray(w, np.float32)))
                            for g, w in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want[:2])))
      ms = time_ms(fn, *inputs, iters=5, reps=3)
      ideal = sum(a.size * a.dtype.itemsize for a in inputs) + 2 * inputs[0].shape[0] * prologue.width(inputs)
      row.update(ms=ms, gb_s=ideal / ms / 1e6, of_copy=ideal / ms / 1e6 / copy_gbs)
    except Exception as e:
      row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    print(row, flush=True)
    rows.append(row)
    return row

  try:
    for case, (inputs, prologue) in cases.items():
      for spec_name, spec in specs.items():
        for strategy in ("rows", "tiles"):
          tuning.QUANTIZE_STATS_FROM_TILES = frozenset({type(prologue).__name__} if strategy == "tiles" else ())
          run(f"{case} {spec_name} {strategy}", inputs, prologue, spec)
        if isinstance(prologue, qkernels.SwiGLU):  # the op in XLA, then the identity kernels
          tuning.QUANTIZE_STATS_FROM_TILES = frozenset({"Identity"})
          row = {"name": f"{case} {spec_name} xla op + tiles"}
          try:
            fn = jax.jit(lambda a, s=spec: qkernels.fused_quantize_kernel((qkernels.SwiGLU().reference((a,)),),
                                                                         qkernels.Identity(), s, s))
            ms = time_ms(fn, *inputs, iters=5, reps=3)
            row.update(ms=ms)
          except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
          print(row, flush=True)
          rows.append(row)
    if sweep:
      for case in ("identity 16384x16384 (gate_up g)", "swiglu 16384x16384->8192", "identity 16384x2048 (attn out x, down g)"):
        inputs, prologue = cases[case]
        name = type(prologue).__name__
        tuning.QUANTIZE_STATS_FROM_TILES = frozenset({name})
        for tile in ((32, 128, 4), (64, 128, 4), (64, 128, 8), (64, 256, 8), (128, 128, 8), (128, 256, 8)):
          tuning.QUANTIZE_STATS_TILE[name] = tile
          run(f"{case} int8 stats tile", inputs, prologue, specs["int8"], stats_tile=tile)
        timed = [r for r in rows if r["name"] == f"{case} int8 stats tile" and "ms" in r]
        if timed:
          tuning.QUANTIZE_STATS_TILE[name] = tuple(min(timed, key=lambda r: r["ms"])["stats_tile"])
        for tile in ((32, 128, 4), (64, 128, 4), (64, 64, 4), (128, 64, 4), (64, 128, 8), (128, 128, 8)):
          tuning.QUANTIZE_TILE[name] = tile
          run(f"{case} int8 write tile", inputs, prologue, specs["int8"], write_tile=tile)
        tuning.QUANTIZE_STATS_TILE.update(saved[1]), tuning.QUANTIZE_TILE.update(saved[2])
  finally:
    tuning.QUANTIZE_STATS_FROM_TILES = saved[0]
    tuning.QUANTIZE_STATS_TILE.clear(), tuning.QUANTIZE_STATS_TILE.update(saved[1])
    tuning.QUANTIZE_TILE.clear(), tuning.QUANTIZE_TILE.update(saved[2])
  return rows


def tune_quantize(m=16384, k=8192):
  """Sweep the row kernel's block shape (rows per program, columns per load, warps)."""
  x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
  copy_ms = time_ms(jax.jit(lambda x: x * 2), x)
  copy_gbs = 2 * x.size * 2 / copy_ms / 1e6
  rows = []
  for spec in (QuantSpec("int8"), QuantSpec("float8_e4m3fn", power_of_two=True)):
    for block, chunk, warps in itertools.product([8, 16, 32], [512, 1024, 2048], [4, 8]):
      if block * chunk > 32768:
        continue
      tuning.QUANTIZE_ROWS["int8" if spec.is_int8 else "fp8"] = (block, chunk, warps)
      row = {"spec": spec.dtype, "block": block, "chunk": chunk, "warps": warps}
      try:
        fn = jax.jit(functools.partial(qkernels.quantize_rows_kernel, spec=spec))
        ms = time_ms(fn, x)
        row.update(ms=ms, of_copy=x.size * (2 + jnp.dtype(spec.dtype).itemsize) / ms / 1e6 / copy_gbs)
      except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
      rows.append(row)
  rows.sort(key=lambda r: -r.get("of_copy", 0))
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--sizes", type=int, nargs="*", default=[8192], help="square sizes M=N=K")
  parser.add_argument("--mnk", nargs="*", default=[], help="extra M,N,K problems, e.g. 16384,8192,2048")
  parser.add_argument("--only", nargs="*", help="substrings of variant names to run")
  parser.add_argument("--tune", type=int, nargs=3, metavar=("M", "N", "K"))
  parser.add_argument("--tune-dtype", default="int8", choices=["int8", "fp8"])
  parser.add_argument("--quantize", action="store_true")
  parser.add_argument("--tune-quantize", action="store_true")
  parser.add_argument("--fused", action="store_true", help="fused RMSNorm / SwiGLU quantizers at 1B shapes")
  parser.add_argument("--tune-fused", action="store_true", help="sweep the fused quantizers' block shapes")
  parser.add_argument("--column-scales", action="store_true",
                      help="rows + transposed quantizers: column scales from the rows kernel vs the tiled passes")
  parser.add_argument("--swiglu-grad", action="store_true", help="SwiGLU's backward: XLA against the values kernel")
  parser.add_argument("--out", help="JSON path (default benchmarks/results/<name>.json)")
  args = parser.parse_args()
  if args.tune:
    rows = tune(*args.tune, dtype=args.tune_dtype)
    path = write_json(f"gemm_tune_{args.tune_dtype}", rows, args.out)
    print(table(rows[:12], ["tops", "ms", "tile_m", "tile_n", "stages", "grid_minor_dim", "grid_tile_width",
                            "wg_dimension", "wgmma_in_flight", "error"]))
  elif args.tune_quantize:
    rows = tune_quantize()
    path = write_json("quantize_tune", rows, args.out)
    print(table(rows[:10], ["spec", "block", "chunk", "warps", "ms", "of_copy", "error"]))
  elif args.tune_fused:
    rows = tune_fused()
    path = write_json("fused_quantize_tune", rows, args.out)
    for op in dict.fromkeys(r["op"] for r in rows):
      best = min((r for r in rows if r["op"] == op and "ms" in r), key=lambda r: r["ms"], default={"op": op})
      print(best)
  elif args.column_scales:
    rows = bench_column_scales()
    path = write_json("column_scales", rows, args.out)
    print(table(rows, ["name", "stats_tile", "write_tile", "ms", "gb_s", "of_copy", "mismatch", "error"]))
  elif args.swiglu_grad:
    rows = bench_swiglu_grad()
    path = write_json("swiglu_grad", rows, args.out)
    print(table(rows, ["name", "ms", "gb_s", "mismatch", "error"]))
  elif args.fused:
    rows = bench_fused()
    path = write_json("fused_quantize", rows, args.out)
    print(table(rows, ["name", "ms", "gb_s", "of_copy", "mismatch", "error"]))
  elif args.quantize:
    rows = bench_quantize()
    path = write_json("quantize", rows, args.out)
    print(table(rows, ["name", "ms", "gb_s", "of_copy", "mismatch", "error"]))
  else:
    extra = [tuple(int(v) for v in p.split(",")) for p in args.mnk]
    rows = bench_gemm([(s, s, s) for s in args.sizes] + extra, args.only)
    path = write_json("gemm", rows, args.out)
    print(table(rows, ["name", "m", "n", "k", "ms", "tops", "rel_err", "error"]))
  print("wrote", path)


if __name__ == "__main__":
  main()
