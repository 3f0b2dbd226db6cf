"""benchmarks/train_throughput.py under FSDP on 2 of the virtual CPU devices: what issue 29's 2-GPU script reads.

One run of a micro model (float32, so XLA:CPU keeps every collective's element type) with two variants and the
one-device row: every FSDP row carries its compile time and its collective bytes by mesh axis, op and element
type; ratios compare rows of one variant; a time budget of 0 s skips (and lists) every row.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
MICRO = {"model.d_model": 32, "model.n_layers": 1, "model.n_heads": 2, "model.n_kv_heads": 1, "model.d_ff": 64,
         "model.dtype": "float32", "steps": 12, "batch_size": 4, "seq_len": 32, "lr": 0.01, "warmup_steps": 2,
         "mesh.fsdp": 2}


def _benchmark():
  spec = importlib.util.spec_from_file_location("benchmark_train_throughput", REPO / "benchmarks" / "train_throughput.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _run(tmp_path, *extra) -> dict:
  out = tmp_path / "throughput.json"
  _benchmark().main(["--configs", f"{REPO / 'configs' / 'layers_8b.py'}:bf16", "--steps", "1", "--warmup", "1",
                     "--out", str(out), *[arg for k, v in MICRO.items() for arg in ("--set", f"{k}={v}")], *extra])
  return json.loads(out.read_text())


def test_rows_report_bytes_by_axis_and_ratios_within_their_variant(tmp_path, capsys):
  result = _run(tmp_path, "--variants", ";fsdp.grad_reduce_dtype=bfloat16", "--one_device_row")
  names = [r["name"] for r in result["rows"]]
  assert names == ["layers_8b:bf16", "layers_8b:bf16 one device", "layers_8b:bf16 [fsdp.grad_reduce_dtype=bfloat16]"]
  fsdp_row, one, bf16_reduce = result["rows"]
  assert fsdp_row["devices"] == 2 and fsdp_row["mesh"] == {"data": 1, "fsdp": 2} and one["devices"] == 1
  assert one["batch_size"] == MICRO["batch_size"] // 2 and one["bytes_by_axis"] == {}
  for row in (fsdp_row, bf16_reduce):
    assert row["compile_s"] > 0 and row["speedup_vs_bf16"] == 1.0  # each is its own variant's bf16 row
    np.testing.assert_allclose(row["per_device_vs_one_device"], row["tokens_per_s_per_device"] / one["tokens_per_s"])
    per_axis = row["bytes_by_axis"]
    assert set(per_axis) == {"fsdp"}, per_axis  # one FSDP axis; data and tensor hold one device
    # the weights gather in float32 (a bf16 recipe, float32 compute); the gradients come back reduce-scattered
    assert set(per_axis["fsdp"]["all-gather"]) == {"f32"} and per_axis["fsdp"]["reduce-scatter"]
  assert bf16_reduce["grad_reduce_dtype"] == "bfloat16" and fsdp_row["grad_reduce_dtype"] == "float32"
  assert fsdp_row["compiler_options"] == {}  # CPU devices: no XLA overlap options
  printed = capsys.readouterr().out
  assert "collective bytes per step and device, by mesh axis" in printed and "fsdp: AG f32" in printed


def test_time_budget_skips_rows_and_lists_them(tmp_path):
  result = _run(tmp_path, "--variants", ";mesh.xla_overlap=false", "--time_budget_s", "0")
  first, second = result["rows"]
  assert "tokens_per_s" not in first and first["skipped"] == "time budget"
  assert second["name"] == "layers_8b:bf16 [mesh.xla_overlap=False]" and second["skipped"] == "time budget"


def test_policy_variants_set_the_dispatch_constant_for_their_rows_only(tmp_path):
  """``policy.NAME=value`` in a variant sets pallas_kernels.policy.NAME while that row is built and timed (the A/B of
  a kernel against the default dispatch), its step traces afresh under it (the trainer's step cache is keyed on the
  policy's constants too: on the GPU a variant row once reused the default row's step), the constant is restored
  after, and an unknown name stops the run before anything compiles."""
  from unittest import mock

  from pallas_kernels import dispatch, policy
  from train import steps

  steps._step_functions.cache_clear()  # a step another test cached for the same spec would not trace here
  module = _benchmark()
  seen, real = [], module.bench_one

  def recording(*args, **kwargs):
    seen.append(policy.TERNARY_WEIGHTS_ON_KERNEL)
    return real(*args, **kwargs)

  module.bench_one = recording
  out = tmp_path / "throughput.json"
  micro = {**MICRO, "mesh.fsdp": 1}  # one device: BitNet's forward quantizes its weights itself (FSDP gathers codes)
  common = ["--configs", f"{REPO / 'configs' / 'layers_8b.py'}:bitnet", "--steps", "1", "--warmup", "1",
            "--out", str(out), *[arg for k, v in micro.items() for arg in ("--set", f"{k}={v}")]]
  default = policy.TERNARY_WEIGHTS_ON_KERNEL
  traced, quantize = [], dispatch.quantize_ternary_weight  # called as the step traces, never by a cached step

  def tracing(*args, **kwargs):
    traced.append(policy.TERNARY_WEIGHTS_ON_KERNEL)
    return quantize(*args, **kwargs)

  with mock.patch.object(dispatch, "quantize_ternary_weight", tracing):
    module.main([*common, "--variants", f";policy.TERNARY_WEIGHTS_ON_KERNEL={not default}"])
  assert seen == [default, not default] and policy.TERNARY_WEIGHTS_ON_KERNEL == default
  assert default in traced and (not default) in traced, traced
  rows = json.loads(out.read_text())["rows"]
  assert rows[1]["name"] == f"layers_8b:bitnet [policy.TERNARY_WEIGHTS_ON_KERNEL={not default}]"
  assert all("tokens_per_s" in r for r in rows)
  with pytest.raises(SystemExit, match="NO_SUCH_CONSTANT"):
    module.main([*common, "--variants", "policy.NO_SUCH_CONSTANT=1"])
  assert len(seen) == 2  # nothing compiled for the refused run
