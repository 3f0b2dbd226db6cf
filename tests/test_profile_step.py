"""benchmarks/profile_step.py's trace arithmetic: per-GPU averages and the collective timeline (issue 29).

Synthetic kernel lists stand in for a two-GPU trace (the CPU has no GPU planes); each case has a figure that a
wrong interval computation would change.
"""

import pytest

from benchmarks import profile_step


def kernel(name, start_us, duration_us, device, hlo_op=""):
  return (name, int(start_us * 1000), int(duration_us * 1000), {"device": device, "hlo_op": hlo_op})


GPU0, GPU1 = "/device:GPU:0", "/device:GPU:1"


def test_collective_kind_from_kernel_or_hlo_name():
  assert profile_step.collective_kind("ncclDevKernel_AllGather_RING_LL", "") == "all_gather"
  assert profile_step.collective_kind("ncclDevKernel_ReduceScatter_Sum_f32", "") == "reduce_scatter"
  assert profile_step.collective_kind("nccl_kernel", "all-reduce-start.3") == "all_reduce"
  assert profile_step.collective_kind("ncclDevKernel_SendRecv", "collective-permute") == "other"


def test_exposed_time_is_the_collective_time_no_compute_kernel_overlaps():
  kernels = [
      # GPU 0: a 10 us all-gather, 6 us of it under a GEMM (0-4 us exposed before, none after).
      kernel("ncclDevKernel_AllGather", 0, 10, GPU0),
      kernel("gemm", 4, 8, GPU0),
      # GPU 1: the same all-gather with nothing beside it, and a reduce-scatter half under two kernels.
      kernel("ncclDevKernel_AllGather", 0, 10, GPU1),
      kernel("ncclDevKernel_ReduceScatter", 20, 8, GPU1),
      kernel("fusion", 20, 2, GPU1),
      kernel("fusion", 21, 3, GPU1),  # overlaps the first: counted once
  ]
  categories = [profile_step.categorize(k[0], "", None, (1,)) for k in kernels]
  assert categories.count("collective") == 3
  timeline = profile_step.collective_timeline(kernels, categories, steps=1)
  assert timeline["devices"] == 2
  # Per GPU: all-gather (10 + 10) / 2; reduce-scatter 8 / 2.
  assert timeline["ms_per_step"] == pytest.approx({"all_gather": 0.010, "reduce_scatter": 0.004})
  # Exposed: all-gather (4 + 10) / 2, reduce-scatter (8 - 4) / 2.
  assert timeline["exposed_ms_per_step"] == pytest.approx({"all_gather": 0.007, "reduce_scatter": 0.002})
  assert timeline["exposed_ms"] == pytest.approx(0.009)


def test_breakdown_averages_over_devices_and_counts_each_devices_idle_time():
  kernels = [kernel("gemm", 0, 6, GPU0), kernel("gemm", 8, 2, GPU0),  # span 10, busy 8
             kernel("gemm", 100, 10, GPU1)]  # span 10, busy 10 (its clock need not match GPU 0's)
  result = profile_step.breakdown(kernels, {}, {}, tokens=(1,), steps=2)
  assert result["devices"] == 2
  assert result["ms_per_step"]["gemm_fwd"] == pytest.approx(18e-3 / 2 / 2)
  assert result["ms_per_step"]["idle"] == pytest.approx(2e-3 / 2 / 2)
  assert result["span_ms_per_step"] == pytest.approx(20e-3 / 2 / 2)
  assert "collectives" not in result


def test_overlapping_collectives_count_once_in_the_exposed_time():
  """Two collectives at once with nothing else running: the step waited 10 us, not 20."""
  kernels = [kernel("ncclDevKernel_AllGather", 0, 10, GPU0), kernel("ncclDevKernel_ReduceScatter", 0, 10, GPU0)]
  timeline = profile_step.collective_timeline(kernels, ["collective", "collective"], steps=1)
  assert timeline["total_ms"] == pytest.approx(0.020)
  assert timeline["exposed_ms"] == pytest.approx(0.010)
  assert timeline["exposed_ms_per_step"] == pytest.approx({"all_gather": 0.010, "reduce_scatter": 0.010})


def test_a_gemm_returning_a_tuple_is_classified_by_its_result():
  """cuBLAS custom calls return (result, workspace): dW [K, N] has no token axis, dx [tokens / devices, K] has
  a device's share of them under FSDP."""
  hlo = ("  %custom-call.7 = (bf16[2048,3072]{1,0}, s8[4194304]{0}) custom-call(%a, %b)\n"
         "  %custom-call.8 = (bf16[8192,2048]{1,0}, s8[4194304]{0}) custom-call(%c, %d)\n")
  shapes = profile_step.hlo_output_shapes(hlo)
  assert shapes == {"custom-call.7": (2048, 3072), "custom-call.8": (8192, 2048)}
  tokens = (16384, 8192)  # the microbatch's tokens, and one of two FSDP devices' share
  assert profile_step.gemm_kind("transpose(jvp(x))/dot_general", shapes["custom-call.7"], tokens) == "gemm_grad_weight"
  assert profile_step.gemm_kind("transpose(jvp(x))/dot_general", shapes["custom-call.8"], tokens) == "gemm_grad_input"
