"""The dispatch policy: which backend runs, and every threshold that decides it.

``dispatch`` (training GEMMs and quantizers) and ``inference_dispatch`` (weight-quantized
GEMMs) ask this module and nothing else; kernel *configurations* (tile shapes per problem)
live in ``tuning``. Every number below comes from a recorded run on the GPU runner (H200, jax
0.11.2; the JSON files in ``benchmarks/results/`` named beside each).

Backends (:data:`BACKENDS`): ``auto`` (default: a kernel where the device supports it and the numbers
say it wins, XLA elsewhere), ``xla`` (the references everywhere) or ``pallas`` (the kernels for every
shape they can take; a clear error where they cannot run: a GEMM off Hopper, and on a device with the
kernels, a quantizer or fused Adam shape they do not tile. A bare per-tensor cast, tiles of a column-split matrix
and a ternary weight split over devices have no kernel on purpose: XLA runs them). Every decision below takes
the backend as an argument: callers hold it in ``dispatch.DispatchOptions`` (``jaxlowbit.ExecutionOptions``
above that). ``$JAXLOWBIT_BACKEND`` is read in one place, :func:`requested_backend`, which the options'
``from_environment()`` calls where a caller passed none.
"""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp

BACKEND_ENV = "JAXLOWBIT_BACKEND"
BACKENDS = ("auto", "xla", "pallas")

# Compute capabilities (major): Hopper (sm90) has wgmma and FP8 tensor cores; the Triton-backend
# kernels need int8/bf16 mma, Ampere (sm80) or newer.
HOPPER = 9
AMPERE = 8
FP8_TYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))

# --- Training GEMM (pallas_kernels.hopper_gemm) ------------------------------------------------
# gemm_sizes_h200.json: with one scale per tensor, XLA's FP8 dot (cuBLASLt) beats the kernel up
# to 2048^3 (548 vs 225 TOP/s at 2048^3); from 4096^3 the kernel is ahead.
PER_TENSOR_MIN_OPS = 4096**3
# Problems smaller than one CTA tile (128 x 256) in M or N would be mostly padding.
GEMM_MIN_M, GEMM_MIN_N = 128, 256

# --- Fused quantizers (pallas_kernels.quantize prologues), fused_quantize_tune_h200.json -----------
# Rows + transposed int8 copy of an RMSNorm of 16384 x 2048: fused kernel 0.147 ms against 0.18 for
# the norm in XLA and the quantize kernels on its written output. SwiGLU of 16384 x 16384 -> 8192:
# fused 0.81 ms against 0.70 (XLA's elementwise pass is cheaper than the kernels' recomputation), so
# the SwiGLU producer keeps the op in XLA and quantizes its output.
# RmsNormApply (the norm with its statistic given) reads what RmsNorm reads.
FUSED_PROLOGUES = frozenset({"RmsNorm", "RmsNormApply"})

# --- Fused optimizer update (pallas_kernels.adam) ------------------------------------------------
# The Triton lowering converts to float8_e4m3fn only on sm89+; compute_capability() reads the
# major version, so FP8 optimizer states take the kernel from Hopper (sm90) on.
FP8_STATE_KINDS = frozenset({"e4m3"})
# Under ``auto`` the fused kernel takes every state kind it runs for, the step (the kernel writes the
# parameter) and the update (it returns u) alike. 1.1B parameter shapes, optax.adamw 8.00 ms
# (optim_step_h200.json): the step 8-bit 7.43 ms vs XLA's 12.63, 4-bit 6.60 vs 12.39, FP8 5.33 vs
# 9.59; update + apply 8-bit 10.45 vs 12.64, 4-bit 8.37 vs 12.47, FP8 7.30 vs 9.27. (Until the kernel
# gathered dynamic-map values from a table, its 8-bit update was slower than XLA's.)


# --- Inference GEMMs (pallas_kernels.inference_dispatch), inference_h200.json ------------------
# Chained-layer timings (us per linear, 4096x14336 / 14336x4096 weights, one run):
# W8A16: kernel 28/30 vs XLA 35/31 at M=1; XLA 20-21 vs kernel 24-27 at M=2..8 (XLA's split-K GEMM
# fusion); kernel 23-24 vs XLA 26-28 at M=16 and 26-30 vs 29-31 at M=32; XLA from M=64.
W8A16_KERNEL_M = ((1, 1), (16, 32))  # inclusive M ranges that take the kernel
# W8A8: XLA's int8 dot matched or beat the A8W8 kernel at every M <= 64 (22-31 vs 25-36 us), so
# auto never takes it (JAXLOWBIT_BACKEND=pallas does).
W8A8_KERNEL_MAX_M = 0
# W8A8 on CUDA cores (pallas_kernels.dp4a_gemv: the int8 weight read as int32 words, one dp4a per word and row of
# x, exact int32 sums, the reference's epilogue): bit-identical to XLA's int8 dot (tests/test_inference_gpu.py). One
# H200 at M = 1 (device time per linear, 8 weights a call; w8a8_dp4a_tilings_h200_0c42e16.json), x quantized inside the
# GEMV against XLA's quantizer and int8 dot: 1B qkv 3.6 against 6.8 us, out 2.8 / 5.5, gate_up 11.7 / 14.6, down 9.1 /
# 10.5, 4096 x 14336 19.3 / 20.1, 14336 x 4096 20.6 / 24.9. M = 2 was not timed (its outputs were: bit-identical).
W8A8_GEMV_MAX_M = 1
# Whether W8A8's float-input linear quantizes x inside that GEMV (one launch) rather than in XLA's quantizer first.
# The kernels' int8 codes are XLA's on the GPU: 0 of 3.1M rows-quantizer codes and 0 of 213K decode-norm codes
# differed (quantizer_agreement_h200_7477bf2.json, INT8_DIVISION "reciprocal"), and a 4-layer W8A8 decode through it
# gave XLA's logits bit for bit at batch 1 and 2 (w8a8_dp4a_tilings_h200_0c42e16.json). 1B decode at batch 1 on one
# H200, one process: 1,540 tokens/s against 1,421 with XLA's quantizer before the GEMV and 1,360-1,376 with XLA's int8
# dot (w8a8_dp4a_h200_0c42e16.json).
W8A8_GEMV_QUANTIZES = True
# Under JAXLOWBIT_BACKEND=pallas the GEMV kernels take M up to this; wgmma takes larger M.
GEMV_MAX_M = 64
# Ternary: the A8W2 kernel reads a quarter of the int8 bytes: 30-34 us vs 35-58 for unpack + XLA at M <= 32.
TERNARY_KERNEL_MAX_M = 32
# Ternary on CUDA cores (pallas_kernels.dp4a_gemv: quantizer inside, one dp4a per weight byte). One H100, the
# kernel alone against the old shift-and-multiply form of the same kernel (2026-11-27, gemv sweep in
# benchmarks/results/ternary_gemv_dp4a_sweep_h100.json): 4096 x 14336 at M = 1 in 10.7 us (was 17.5; bf16 41.6),
# at M = 4 in 23-28 us (was 181; the quantizer + A8W2 kernel took 37-39 in a8w2_sweep_m8_h100_128ffef.json), and
# 14336 x 4096 at M = 4 in 34.5 us (that path: 43-49). The 1B shapes at M = 4 were not timed on the A8W2 path
# beside it. Its outputs equal the XLA quantizer + A8W2 reference bit for bit; a converted
# layer reproduces its training forward also for float32 inputs since every layer rounds its input cast explicitly
# (quantize.to_compute_dtype: XLA had dropped the bare float32 -> bf16 round trip inside its quantizer fusion).
# Since the A8W2 kernel reads x as int32 words and masks its rows (6d76cc2), it takes M = 4 on codes in as little time
# as M = 16, and the GEMV's time grows with M (one dp4a per weight byte and row). One H200 (2026-11-29, device time,
# benchmarks/results/ternary_m1_16_h200_4448fdb.json): at M = 2 the GEMV was faster on all seven 1B / 8B shapes
# (4096 x 14336 8.0 us against 11.9, the 1B gate_up 6.4 / 7.3); at M = 4 the A8W2 kernel was faster or even
# (4096 x 14336 11.9 / 17.0, gate_up 7.3 / 9.5, the 1B down and 4096 x 4096 within 2%). Since the GEMV encodes x
# with cvt.pack and takes bf16 amaxes on integers (9303ebe), M = 3 goes to it as well. One H200, device time, the
# GEMV forced against the default path (benchmarks/results/dp4a_quantizing_tilings_h200_92dcd8b.json): at M = 3 it
# was faster on five of six 1B / 8B shapes (4096 x 4096 6.2 us against 8.3, 4096 x 14336 14.4 / 15.2, the 1B down
# 8192 x 2048 7.1 / 8.9) and slower on 14336 x 4096 (16.7 / 15.5); at M = 4 it lost on both 8B MLP shapes (17.6 /
# 15.4, 20.0 / 15.7). That was float x, quantized inside. On codes (a decode norm's, every M of ternary decode) the
# encoding does not apply, and at M = 3 the A8W2 kernel was faster on the wide shapes (4096 x 14336 12.0 against
# 14.6 us, ternary_m3_w8a8_h200_1055fe9.json): codes keep M <= 2.
TERNARY_GEMV_MAX_M = 3
TERNARY_CODES_GEMV_MAX_M = 2
# High-precision one-row dots (jaxlowbit.matmul; bf16 decode at batch 1): XLA on GPU strength-reduces a dot with
# one row whose operands hold fewer than 10M elements into multiply + reduce, which read the bf16 weight at
# 0.6-1.3 TB/s on an H100 against its GEMM's 2.2-2.8. Given a second (zero) row the dot stays a GEMM: 2048 x 3072
# 11.6 -> 9.4 us, 2048 x 2048 13.9 -> 9.3 us; above the threshold (already a GEMM) the row costs 4-11% (one H100,
# 2026-11-26, benchmarks/results/w8a16_gemv_bf16_matvec_h100_ba701ca.json).
XLA_MATVEC_REDUCE_MAX_ELEMENTS = 10_000_000
# Large M: the wgmma GEMM (128 x 256 CTA tiles, persistent) needs enough output tiles to fill the SMs:
# M=256 x N=4096 (32 tiles) ran 104 us vs XLA's 54; M=256 x N=14336 (112 tiles) 42 vs 54.
WGMMA_TILE_M, WGMMA_TILE_N = 128, 256
WGMMA_MIN_TILES = 64


def requested_backend() -> str:
  """The backend named by ``$JAXLOWBIT_BACKEND`` (``auto`` when unset); ValueError if unknown.

  The only reader of the variable (module docstring).
  """
  value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
  if value not in BACKENDS:
    raise ValueError(f"{BACKEND_ENV}={value!r} is not one of {BACKENDS}")
  return value


def constants() -> tuple[tuple[str, object], ...]:
  """This module's scalar constants as ``(name, value)`` pairs: what a step traced under them depends on
  (``train.steps`` caches its steps on them too, so a benchmark variant that sets one traces afresh)."""
  return tuple((name, value) for name, value in sorted(globals().items())
               if name.isupper() and isinstance(value, (bool, int, float, str)))


def check_backend(backend: str) -> str:
  """``backend`` if it is one of :data:`BACKENDS`, else a ValueError naming them."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r} (or set ${BACKEND_ENV} and pass no options)")
  return backend


_warned_capabilities: set[str] = set()


def compute_capability(device=None) -> int | None:
  """Major NVIDIA compute capability of ``device`` (default device); None where there is none.

  None for CPUs, TPUs and GPUs whose capability is not an NVIDIA ``major.minor`` (ROCm reports
  ``gfx942``): every kernel path then falls back to XLA, with one warning per unknown value.
  """
  device = device or jax.devices()[0]
  if device.platform != "gpu":
    return None
  cc = str(getattr(device, "compute_capability", "") or "")
  major = cc.split(".")[0]
  if major.isdigit():
    return int(major)
  if cc not in _warned_capabilities:
    _warned_capabilities.add(cc)
    warnings.warn(f"jaxlowbit: GPU {device.device_kind!r} reports compute capability {cc!r}, not an NVIDIA sm "
                  "version; its low-bit matmuls run on XLA", stacklevel=2)
  return None


def check_fp8_support(dtype, major: int | None) -> None:
  """NotImplementedError for FP8 operands on an NVIDIA GPU older than Hopper."""
  if jnp.dtype(dtype) in FP8_TYPES and major is not None and major < HOPPER:
    raise NotImplementedError(
        f"FP8 matmuls need an sm90+ GPU (Hopper); this device is sm{major}x. Use Int8MixedPrecision or BitNet."
    )


def gemm_worth_it(m: int, n: int, k: int, per_tensor: bool) -> bool:
  """Whether the Hopper GEMM is expected to beat XLA for an ``[M, K] x [N, K]`` problem."""
  if m < GEMM_MIN_M or n < GEMM_MIN_N:
    return False
  return not (per_tensor and m * n * k < PER_TENSOR_MIN_OPS)


def select_backend(a_dtype, m: int, n: int, k: int, device=None, per_tensor: bool = False, *, backend: str) -> str:
  """``"pallas"`` or ``"xla"`` for a scaled 8-bit GEMM (see :func:`gemm_worth_it`) under ``backend``."""
  requested = check_backend(backend)
  major = compute_capability(device)
  check_fp8_support(a_dtype, major)
  if requested == "xla":
    return "xla"
  if major is None or major < HOPPER:
    if requested == "pallas":
      raise NotImplementedError("backend pallas: the Pallas GEMM needs a Hopper GPU (sm90); use auto or xla "
                                f"(${BACKEND_ENV} or ExecutionOptions.backend)")
    return "xla"
  if requested == "pallas" or gemm_worth_it(m, n, k, per_tensor):
    return "pallas"
  return "xla"


def fuse_prologue(prologue_name: str) -> bool:
  """Whether a fused quantizer computes its prologue in the kernel (else XLA computes it first)."""
  return prologue_name in FUSED_PROLOGUES


# BitNet's ternary weights, quantized for the forward GEMM (codes written transposed, one abs-mean scale) once per
# step, or per microbatch: by XLA (an abs-mean reduce, then a convert + transpose fusion) or by the quantizers' tile
# kernel after XLA's abs-mean (pallas_kernels.quantize), which also writes Wq for grad_input from the same read. In
# the 1B BitNet step on an H200 XLA's transposes took 3.3 ms per step at ~1.5-1.9 TB/s
# (profile_step_1b_bitnet_h200_21b5d4f.json). Timed in one process against the XLA row
# (train_throughput_1b_ternkernel_{h100,h200}_e375cc0.json), the kernel took the step from 163.4 to 162.0 ms on an
# H100 and from 155.7 to 154.3 ms on an H200.
TERNARY_WEIGHTS_ON_KERNEL = True


# The gate_up projection's output gradient quantized (per token and per feature, both int8 layouts from one tiled
# pass) with the amaxes that BitNet's ffn_sub_norm backward measures as it writes it (its values kernel writes
# per-tile maxima), instead of a statistics pass that reads the gradient again (512 MiB per layer of the 1B model,
# 2.5 ms of the BitNet step on an H200: profile_step_1b_bitnet_h200_8966455.json). train.model asks for it
# (ModelConfig.gate_up_measured); False keeps the statistics pass (an A/B variant of benchmarks/train_throughput.py).
MEASURED_GRADIENTS = True


def ternary_weights_on_kernel(backend: str) -> bool:
  """Whether BitNet's ternary weights are quantized by the tile kernel (where it takes the shape) under ``backend``:
  where the quantizers run on kernels at all (:func:`quantize_on_kernel`), under ``pallas`` or with
  :data:`TERNARY_WEIGHTS_ON_KERNEL`."""
  return quantize_on_kernel(backend) and (backend == "pallas" or TERNARY_WEIGHTS_ON_KERNEL)


# How a Pallas quantizer divides by an int8 scale (pallas_kernels.quantize.encode): "reciprocal" multiplies by
# Triton's float32 1 / scale (shipped); "rcp_rn" multiplies by PTX's correctly rounded reciprocal; "div_rn" divides
# each element correctly rounded (div.rn.f32). On one H200 (quantizer_agreement_h200_7477bf2.json, 8 draws each) the
# shipped form's codes were XLA's in every element (0 of 3.1M rows-quantizer codes, 0 of 213K decode-norm codes); the
# correctly rounded forms differed in 1.3-3.1e-4 of them, by one step. The other two forms stay for that A/B.
INT8_DIVISION = "reciprocal"
INT8_DIVISIONS = ("reciprocal", "rcp_rn", "div_rn")


# W8A8 decode: whether the pre-norms of a high-precision model converted for w8a8 hand qkv and gate_up their int8
# codes (jaxlowbit.inference.weights.decode_input_spec), as ternary's norms do, instead of each linear quantizing its
# input; only at the rows the dp4a GEMV quantizes itself (weights.decode_input_rows: one), whose codes the norm
# kernel's equal on the GPU in every element measured (w8a8_dp4a_tilings_h200_0c42e16.json). Handed at every row
# count the norm kernel takes (up to 16, the prefill included), they were not XLA's quantizer's there: the 6-row
# prefill moved 95% of a 4-layer model's logits and its KV cache; with the row rule the decode is bit-identical
# (d_model 512 and 2048, batch 1 and 2, every logit and cache element; w8a8_norm_codes_rows_h200_18fbaca.json). One
# H200, 1B, batch 1, rounds A B A B in one process: 1,760 and 1,744 tokens/s against 1,675 and 1,678 (+4.5%).
W8A8_DECODE_CODES = True


# Fewer rows than this are quantized by XLA under auto: decode at batch 2..16 quantizes a few rows per linear per
# token, and the rows kernel (8 rows per program) then ran one program on one SM: [8, 8192] in ~9 us on an H100,
# 268 us per token of the 1B ternary model at batch 8 (inference_decode_profile_1b_batch8_h100_2129284.json);
# XLA spreads the rows' reduction, and the A8W2 kernel reads its codes as they are (a bitcast view). Training's
# operands (thousands of token rows) keep the kernels.
QUANTIZE_KERNEL_MIN_ROWS = 64


def quantize_rows_to_xla(rows: int, backend: str) -> bool:
  """Whether an operand of ``rows`` rows is quantized by XLA rather than a kernel: under ``auto`` below
  :data:`QUANTIZE_KERNEL_MIN_ROWS` (``pallas`` forces the kernels at every size)."""
  return check_backend(backend) == "auto" and rows < QUANTIZE_KERNEL_MIN_ROWS


def quantize_on_kernel(backend: str) -> bool:
  """Whether quantization may run on the Triton-backend kernels under ``backend`` (each also checks its shapes)."""
  major = compute_capability()
  return check_backend(backend) != "xla" and major is not None and major >= AMPERE


def adam_kernel_runs(kinds: tuple[str, ...]) -> bool:
  """Whether the fused Adam kernel runs here for moments stored as ``kinds`` (``BlockFormat.kind``
  of ``m`` and ``v``): an NVIDIA GPU from sm80, sm90 for e4m3 states."""
  major = compute_capability()
  if major is None or major < AMPERE:
    return False
  return major >= HOPPER or not FP8_STATE_KINDS.intersection(kinds)


def adam_on_kernel(kinds: tuple[str, ...], backend: str) -> bool:
  """Whether the low-bit Adam update or fused step runs on the kernel under ``backend`` for moments
  stored as ``kinds`` (``(m kind, v kind)``); the kernel also checks each tensor's shape.

  ``auto`` and ``pallas``: wherever it runs (:func:`adam_kernel_runs`; measured faster than XLA for
  every kind); ``xla``: never. Like the quantizers, a forced ``pallas`` on a device without the
  kernel falls back to XLA rather than failing (the two are one spec); on a device with it, a
  tensor it cannot take is an error under ``pallas`` (``dispatch``), as for the quantizers.
  """
  return check_backend(backend) != "xla" and adam_kernel_runs(kinds)


def w8a16_kernel_wanted(m: int) -> bool:
  return any(lo <= m <= hi for lo, hi in W8A16_KERNEL_M)


def gemv_max_m(kernel_max_m: int, backend: str) -> int:
  """Largest M a GEMV kernel takes: ``kernel_max_m`` under auto, :data:`GEMV_MAX_M` when forced."""
  return max(kernel_max_m, GEMV_MAX_M if check_backend(backend) == "pallas" else 0)


def matvec_needs_second_row(k: int, n: int) -> bool:
  """Whether a one-row ``[1, K] x [K, N]`` high-precision dot should get a zero second row: on an NVIDIA GPU,
  below XLA's strength-reduction size (:data:`XLA_MATVEC_REDUCE_MAX_ELEMENTS` elements in both operands)."""
  return k + k * n < XLA_MATVEC_REDUCE_MAX_ELEMENTS and compute_capability() is not None


def wgmma_fills_gpu(m: int, n: int) -> bool:
  """Whether an ``[M, N]`` output has enough wgmma tiles to fill the GPU (else XLA is faster)."""
  return (-(-m // WGMMA_TILE_M)) * (-(-n // WGMMA_TILE_N)) >= WGMMA_MIN_TILES


def use_inference_kernel(who: str, wanted: bool, fits: bool, backend: str) -> bool:
  """True to run an inference kernel under ``backend``, False for its reference; raises where a forced
  kernel cannot run."""
  requested = check_backend(backend)
  if requested == "xla":
    return False
  major = compute_capability()
  if major is None or major < AMPERE:
    if requested == "pallas":
      where = "a CPU or non-NVIDIA device" if major is None else f"an sm{major}x GPU"
      raise NotImplementedError(
          f"backend pallas: the {who} kernel needs an NVIDIA GPU with sm80+ (Ampere or newer), "
          f"this is {where}; use auto or xla (unset {BACKEND_ENV}, or ExecutionOptions.backend) for the XLA path"
      )
    return False
  if not fits:
    if requested == "pallas":
      raise ValueError(f"backend pallas: the {who} kernel cannot tile this weight (see its supports()); "
                       f"use auto (unset {BACKEND_ENV}) to let the XLA path take it")
    return False
  return requested == "pallas" or wanted

# Decode-sized RMSNorms (at most pallas_kernels.decode.NORM_ROWS_MAX rows) as one Pallas kernel on a GPU instead of
# XLA's reduce and elementwise pass (with the gated activation before BitNet's ffn_sub_norm, or the residual add
# before a pre-norm, folded in): decode ran ~19 kernels per layer, each a launch of its own
# (benchmarks/results/decode_kernels_on_h200_bddc8c0.json). False keeps XLA's (for A/B runs:
# benchmarks/inference.py --xla-decode-ops).
DECODE_NORM_KERNEL = True

# A decode step's attention (RoPE of the new query and key, the KV cache write, attention over the cache) as one
# Pallas kernel on a GPU (pallas_kernels.decode.decode_attention_kernel) instead of XLA's six kernels per layer, for
# caches of any length and either KV cache dtype. Up to 512 positions one program per sequence and KV head walks the
# cache: the 1B model's heads on an H200 took 25-33 us per layer against XLA's 38-51 at 128-512 positions and batch 1
# (28-31 against 27-46 at batch 8; benchmarks/results/decode_attention_sweep_h200_75bfaaf.json, 16 layers chained).
# Longer caches (over decode.ATTENTION_SPLIT_FROM) are split over decode.ATTENTION_PROGRAMS_PER_SM programs per SM.
# Split at one per SM, the 1B decode at a 2048-position cache on one H200 took 886 us a token against 906 with XLA's
# attention (bf16 weights and cache), 910 against 1,040 (bf16 weights, int8 cache), 493 against 649 (ternary
# weights, int8 cache), and at batch 8 1,054 against 1,552 (bf16 weights, int8 cache)
# (benchmarks/results/decode_long_attention_h200_e471c1d.json). False keeps XLA's (benchmarks/inference.py
# --xla-decode-ops).
DECODE_ATTENTION_KERNEL = True

# The decode kernels (the norm, the attention step, the dp4a GEMV, the A8W2 / A8W8 GEMM, W8A16) open with PTX's
# ``griddepcontrol.launch_dependents`` on a GPU (pallas_kernels.launch.early_launch): under XLA's programmatic
# dependent launch (Hopper; on by default in jax 0.11.2's XLA) the next kernel may then be scheduled onto free SMs
# once every program of this one has issued it, and it waits at the ``griddepcontrol.wait`` XLA puts at its start
# for this one to finish. Without the trigger the next kernel is scheduled only once every program of this one has
# exited. The 1B decode at batch 1 on one H200, off then on in two alternating rounds of one process
# (benchmarks/results/pdl_early_launch_ab_h200_fb18e61.json): ternary 2,440 / 2,396 -> 2,624 tokens/s (+7.5% /
# +9.5%), w8a8 1,740 / 1,747 -> 1,809, w8a16 1,659 / 1,664 -> 1,710, bf16 (its norms and attention are ours) 1,210 /
# 1,229 -> 1,242 / 1,242. On, on this evidence (one H200, jax 0.11.2, 2026-11-30):
# - tests/test_decode_kernels.py::test_the_early_launch_trigger_moves_no_output_on_gpu: a 2-layer decode at 1B
#   widths gives bit-identical logits with and without the trigger for bf16, w8a16, w8a8 and ternary (its earlier
#   stall was the test's own: parameters closed over as executable constants, compressed by the suite's compilation
#   cache at every compile). With it on, all 44 GPU tests of tests/test_decode_kernels.py passed, and the 56 of
#   tests/test_inference_gpu.py's 78 that ran before the call's time limit;
# - a successor that read before its wait would do so while ours runs (the trigger is our first instruction, so the
#   window is the whole kernel, microseconds, not a narrow race), and would differ on nearly every token.
# What is not shown: the compiled successors' PTX. The wait orders only the loads after it; a load the compiler
# treats as invariant (non-coherent) may be hoisted above it, as openxla/xla#43894 found for the kernels XLA's own
# trigger lets start early, and no XLA dump flag of jax 0.11.2 tried wrote PTX. False turns the trigger off
# (benchmarks/inference.py --no-early-launch).
PDL_EARLY_LAUNCH = True
# The W8A16 kernel (pallas_kernels.w8a16) issues that trigger only for weights of up to this many bytes (int8: one a
# weight), at every M (measured at M = 1 only): the CUDA-core GEMV's at M = 1 (w8a16.GEMV_MAX_ELEMENTS), not the
# tensor-core tiles of larger weights. On Llama 3 8B's layers the tiles' trigger cost 8% of the W8A16 decode; on the
# 1B model it gave 1.5%. One H200, batch 1, alternating rounds of one process (benchmarks/decode_ab.py; tokens/s,
# medians of two rounds):
# - 8B layers (decode_ab_8b_layers_w8a16_trigger_bytes_h200_48516ea.json): every W8A16 kernel triggering 2,661; up to
#   32 MiB (qkv and out, not gate_up and down) 2,796; up to 6 MiB (no tensor-core tile) 2,879. In two other calls:
#   no tile 2,864 against 2,662, no W8A16 kernel 2,875 against 2,665, no kernel of ours at all 2,922.
# - 1B (decode_ab_1b_w8a16_gemv_trigger_h200_48516ea.json; its tiles are the gate_up and down projections): every
#   kernel 1,775 (rounds 1,793 and 1,757), no tile 1,749 (1,756 and 1,742): ranges that touch.
# The A/B files name this setting as it was then: W8A16_EARLY_LAUNCH = 'gemv' (the same kernels at M = 1) or False.
# Why the trigger slows the large tiles was not found; the kernel after a tile is the next GEMV or XLA's split-K add.
# Outputs do not depend on it. Ternary and W8A8 run no W8A16 kernel; on the 8B layers ternary gave 4,741 tokens/s with
# every trigger and 4,704 with none (decode_ab_8b_layers_ternary_trigger_h200_48516ea.json).
W8A16_EARLY_LAUNCH_MAX_BYTES = 2048 * 3072

# A decode step's gated MLP: its fused gate_up projection returns act(gate) * up itself (train.model.Mlp;
# jaxlowbit.LowBitDense.gated), which the decode GEMVs of a converted model form in their epilogue
# (pallas_kernels.inference_dispatch.gate). The kernel after it then reads d_ff values a token instead of 2 d_ff and
# computes no activation: BitNet's ffn_sub_norm, one program a row, spent ~3.5 us of a 1B ternary layer's ~24 on it
# (H200, decode_profile_1b_h200_9f82a95.json); a W8A16 model ran it as an XLA kernel of its own (1.1 us a layer).
# A model converted for ternary or W8A16 asks for it (jaxlowbit.inference.weights.gated_outputs). One H200, 1B decode
# at batch 1, off / on in alternating rounds of one process (gated_epilogue_ab_h200_4f67962.json): ternary 2,579,
# 2,605 / 2,689, 2,652 tokens/s; W8A16 1,696, 1,709 / 1,753, 1,781. Ternary's logits are bit-identical either way,
# W8A16's within its bf16 bound. Off: the activation after the projection, as before.
GATED_EPILOGUE = True
