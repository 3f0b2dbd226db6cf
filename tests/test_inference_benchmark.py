"""benchmarks/inference.py on CPU: decode rows of the tiny config with their kernel-time profile.

What issue 28's per-token profile reads on the GPU: every decode row splits the kernel time per generated token of
the median of five traced decode calls (the step compiled a second time without CUDA graphs) into
benchmarks/profile_step.py's categories; the linears are found (``gemm_fwd``), the categories and the top kernels
add up to no more than the traced span, the calls' min and max bound the median, and the table is printed.
"""

from __future__ import annotations

import json

from benchmarks import inference as benchmark
from benchmarks.profile_step import CATEGORIES


def test_decode_rows_carry_a_kernel_time_profile_per_token(tmp_path, capsys):
  out = tmp_path / "inference.json"
  benchmark.main(["--shapes", "--decode-config", "tiny", "--decode-schemes", "bf16", "ternary",
                  "--decode-batches", "1", "--long-context", "0", "--prompt-len", "4", "--new-tokens", "5",
                  "--profile-decode", "--out", str(out)])
  rows = json.loads(out.read_text())["decode"]
  assert [r["scheme"] for r in rows] == ["bf16", "ternary"]
  for row in rows:
    assert "error" not in row, row
    profile = row["profile_us_per_token"]
    assert set(profile) == set(CATEGORIES) and min(profile.values()) >= 0
    assert profile["gemm_fwd"] > 0, profile  # the decode step's linears
    kernels = row["profile_kernel_us_per_token"]
    summed = sum(v for c, v in profile.items() if c != "idle")
    assert abs(summed - kernels) <= 1e-6 * kernels  # the categories are the median call's
    assert row["profile_calls"] == benchmark.PROFILE_CALLS == len(row["profile_idle_us_per_token"])
    assert row["profile_kernel_us_min"] <= kernels <= row["profile_kernel_us_max"]
    assert profile["idle"] in row["profile_idle_us_per_token"]
    top = row["profile_top_kernels"]
    assert top and all(k["us_per_token"] > 0 and k["category"] in CATEGORIES for k in top)
    assert sum(k["us_per_token"] for k in top) <= kernels * (1 + 1e-9)
  printed = capsys.readouterr().out
  assert "decode kernel time per token by category" in printed and "gemm_fwd" in printed


def test_timed_runs_last_at_least_the_minimum_run_time():
  """A row's timed runs are long enough that a stall of a few ms cannot dominate one (benchmarks.inference.MIN_RUN_S):
  the call count grows from ``iters`` until a run lasts ``min_run_s`` by the discarded first run's pace."""
  import jax
  import jax.numpy as jnp

  fn = jax.jit(lambda x: jnp.tanh(x) @ x)
  x = jnp.ones((64, 64))
  short = benchmark.time_runs(fn, x, iters=2, runs=3, min_run_s=0.0)
  assert short["iters"] == 2 and len(short["samples_us"]) == 3 and short["us_min"] <= short["us"] <= short["us_max"]
  long = benchmark.time_runs(fn, x, iters=2, runs=3, min_run_s=0.05)
  assert long["iters"] > 2 and len(long["samples_us"]) == 3


def test_decode_rows_reach_the_caller_as_each_is_measured():
  """``on_row`` sees the rows after each one (main writes them to --out then: a call cut by its time limit on the GPU
  keeps the rows it measured, where the H200 profile run of 2026-11-28 lost all of them)."""
  seen = []
  rows = benchmark.bench_decode(benchmark.DECODE_CONFIGS["tiny"], ["bf16", "ternary"], [1], 4, 5, 1,
                                on_row=lambda so_far: seen.append([r["scheme"] for r in so_far]))
  assert seen == [["bf16"], ["bf16", "ternary"]]
  assert [r["scheme"] for r in rows] == ["bf16", "ternary"] and all("error" not in r for r in rows)


def test_the_chain_orders_each_layer_after_the_one_before():
  """benchmarks.inference.chain: layer i + 1's input passes an optimization barrier together with layer i's output,
  so XLA cannot fuse work across layers (a decode cannot either); the outputs are the unchained ones."""
  import jax
  import numpy as np

  xs = [jax.random.normal(jax.random.key(i), (2, 16)) for i in range(3)]
  ws = [jax.random.normal(jax.random.key(10 + i), (16, 16)) for i in range(3)]
  chained = benchmark.chain(lambda x, w: x @ w)
  [call] = jax.make_jaxpr(chained)(xs, ws).jaxpr.eqns
  eqns = call.params["jaxpr"].jaxpr.eqns
  assert [e.primitive.name for e in eqns] == ["dot_general", "optimization_barrier"] * 2 + ["dot_general"]
  for i in (1, 3):
    before, barrier, after = eqns[i - 1], eqns[i], eqns[i + 1]
    assert before.outvars[0] in barrier.invars  # the previous layer's output...
    assert after.invars[0] is barrier.outvars[0]  # ...orders this layer's input
  for got, x, w in zip(chained(xs, ws), xs, ws):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(lambda x, w: x @ w)(x, w)))


def test_device_time_splits_a_trace_into_its_calls():
  """Per-linear times are the device's (benchmarks.inference.gpu_times: one traced span per call, as decode's CUDA
  graph pays them): as many spans as calls, each call the same kernels, a positive median between its min and max,
  divided by the linears a call runs."""
  import jax
  import jax.numpy as jnp

  xs = [jnp.ones((2, 64)) * (i + 1) for i in range(3)]
  ws = [jnp.eye(64) for _ in range(3)]
  chained = benchmark.chain(lambda x, w: jnp.tanh(x @ w)).lower(xs, ws).compile()
  jax.block_until_ready(chained(xs, ws))
  whole = benchmark.gpu_times(chained, xs, ws, calls=4)
  per_linear = benchmark.gpu_times(chained, xs, ws, calls=4, per_call=3)
  for stats in (whole, per_linear):
    assert stats["runs"] == len(stats["samples_us"]) == 4 and stats["kernels_per_call"] >= 1
    assert 0 < stats["us_min"] <= stats["us"] <= stats["us_max"] and 0 < stats["busy_us"]
  assert per_linear["kernels_per_call"] == whole["kernels_per_call"]


def test_each_sweep_row_times_the_kernel_it_names(monkeypatch):
  """``--sweep`` rows: the kernel called is the one the row's ``kernel`` names, at the row's block shape. From
  0c42e16 until this test, an ``elif`` lost inside a comment made the ``a8w8_gemv`` rows time the W8A16 kernel and
  the ``w8a16`` rows the A8W8 GEMM (docs/inference.md, "W8A8 on the dp4a GEMV")."""
  import jax.numpy as jnp

  from pallas_kernels import dp4a_gemv, int8_gemv, w8a16

  called = []

  def fake(name, w_index=2):  # x is the first argument, the weight the third (second: W8A16's, the quantizing GEMVs')
    def kernel(*args, config, **kwargs):
      called.append((name, config.block_n, config.block_k))
      x, w = args[0], args[w_index]
      assert (x.dtype == jnp.int8) == (name in ("ternary_gemv", "a8w8_gemv", "a8w2", "a8w8")), (name, x.dtype)
      return jnp.zeros((x.shape[0], w.shape[0]), jnp.float32)
    return kernel

  monkeypatch.setattr(dp4a_gemv, "a8w2_gemv_kernel", fake("ternary_gemv"))
  monkeypatch.setattr(dp4a_gemv, "a8w8_gemv_kernel", fake("a8w8_gemv"))
  monkeypatch.setattr(dp4a_gemv, "quantize_a8w2_gemv_kernel", fake("quantize_ternary_gemv", w_index=1))
  monkeypatch.setattr(dp4a_gemv, "quantize_a8w8_gemv_kernel", fake("quantize_a8w8_gemv", w_index=1))
  monkeypatch.setattr(w8a16, "w8a16_matmul_kernel", fake("w8a16", w_index=1))
  monkeypatch.setattr(int8_gemv, "a8w2_matmul_kernel", fake("a8w2"))
  monkeypatch.setattr(int8_gemv, "a8w8_matmul_kernel", fake("a8w8"))
  stats = {"us": 1.0, "us_min": 1.0, "us_max": 1.0, "spread": 0.0, "iters": 1}
  monkeypatch.setattr(benchmark, "time_runs", lambda *args, **kwargs: stats)
  monkeypatch.setattr(benchmark, "gpu_times", lambda *args, **kwargs: stats)
  rows = benchmark.bench_kernel_sweep([(4096, 4096)], iters=1, runs=1, layers=1)
  assert rows and all("error" not in r for r in rows), [r.get("error") for r in rows]
  timed = [(r["kernel"], r["block_n"], r["block_k"]) for r in rows]
  assert called == timed
  assert {r["kernel"] for r in rows} == set(benchmark.SWEEP)
