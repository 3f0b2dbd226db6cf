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
