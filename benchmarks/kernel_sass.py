"""A Pallas Triton kernel's machine code for sm_90, read on a machine without a GPU: its hot loop's instruction mix.

    pip install triton==3.6.0          # optional; only this tool needs it (ptxas and cuobjdump ship in the wheel)
    PYTHONPATH=. python -m benchmarks.kernel_sass --k 2048 --n 16384
    PYTHONPATH=. python -m benchmarks.kernel_sass --k 8192 --n 2048 --tiling 32,128,2,4

Why: a decode GEMV is timed on a lent GPU, minutes at a time, and its time alone does not say whether it is bound by
instructions, by memory round trips or by too few warps. What the compiler made of it does, and that costs no device
time: JAX lowers a ``pallas_call`` for CUDA on any machine (``lowering_platforms``), the Triton IR it hands XLA is
captured here (:func:`triton_modules`), and Triton's own compiler turns it into a cubin for sm_90, which its
``cuobjdump`` disassembles (:func:`compile_sass`). :func:`hot_loop` then counts the instructions of the longest loop.

It is a model of what runs, not a reading of it: XLA compiles the same IR with the Triton it bundles, whose version
differs from the pip package's and may schedule differently, and XLA adds its own ``griddepcontrol.wait`` at the
kernel's start. The lowering targets an abstract H100-class device (sm_90, 132 SMs), so no GPU is needed; the
tilings are those :func:`pallas_kernels.w8a16.config_for` picks for 132 SMs. On the W8A16 kernel (1B gate_up, the
shipped tiling) it shows 275 instructions a K step, 4.3 a weight a thread: 2 of them convert int8 to bf16 (PRMT, two
LOP3, HADD2 per pair), about 1.3 move the masked x tile into mma operands (IMAD.MOV, LDS), 0.25 are HMMA. At the
H200's issue rate that is ~7.7 T weights/s, 2.7x what the kernel streams (2.8 TB/s): it waits on latency, not on
issue slots (docs/inference.md).

The tool drives :func:`pallas_kernels.w8a16.w8a16_matmul_kernel` at M = 1 (``--out``: the report as JSON);
:func:`triton_modules`, :func:`compile_sass` and :func:`hot_loop` take any function and any SASS.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

_SASS_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
_FUNCTION = re.compile(r"^\s*Function\s*:")
_BRANCH = re.compile(r"^(?:@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+(0x[0-9a-f]+)")
_LAUNCH = re.compile(r'name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32')
_KERNEL_NAME = re.compile(r"tt\.func public @([\w$.]+)\(")
# The device the kernels are lowered for: what config_for and the Pallas lowering see (an sm_90 GPU of 132 SMs).
SM90 = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
    device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu"))


@dataclasses.dataclass(frozen=True)
class TritonModule:
  """One ``pallas_call`` as XLA receives it: the Triton IR (text) and its launch parameters."""

  name: str
  ir: str
  num_warps: int
  num_stages: int


def triton_modules(fn, *args) -> list[TritonModule]:
  """The Triton modules of every ``pallas_call`` in ``fn(*args)`` (``args``: arrays or ``jax.ShapeDtypeStruct``),
  lowered for CUDA on an abstract sm_90 device (:data:`SM90`) on whatever machine this runs.

  Reads the modules where JAX's Pallas Triton lowering makes them (``lower_jaxpr_to_triton_module``, a private
  function of jax 0.10-0.11), and each one's launch parameters from its custom call, matched by kernel name.
  RuntimeError where that function is gone, or where kernels of one name carry different launch parameters (lower
  them one at a time)."""
  from jax._src.pallas.triton import pallas_call_registration as registration

  original = getattr(registration.lowering, "lower_jaxpr_to_triton_module", None)
  if original is None:
    raise RuntimeError("this jax has no pallas triton lower_jaxpr_to_triton_module; kernel_sass needs jax 0.10-0.11")
  irs = []

  def capture(*a, **k):
    result = original(*a, **k)
    irs.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  registration.lowering.lower_jaxpr_to_triton_module = capture
  try:
    with jax.sharding.use_abstract_mesh(SM90):
      # a new function each call: a lowering JAX cached from an earlier call would run no lowering rule here
      text = jax.jit(lambda *a: fn(*a)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = original
  launches = {}
  for name, stages, warps in _LAUNCH.findall(text):
    launches.setdefault(name, set()).add((int(warps), int(stages)))
  modules = []
  for ir in irs:
    found = _KERNEL_NAME.search(ir)
    name = found.group(1) if found else "?"
    if len(launches.get(name, ())) != 1:
      raise RuntimeError(f"kernel {name!r}: launch parameters {sorted(launches.get(name, ()))} in the lowering; "
                         "lower one such kernel at a time")
    [(warps, stages)] = launches[name]
    modules.append(TritonModule(name, ir, warps, stages))
  return modules


def compile_sass(module: TritonModule) -> tuple[str, int, int]:
  """``(sass, registers a thread, shared memory bytes)`` of ``module`` compiled for sm_90 by the ``triton``
  package (ImportError naming the install if it is missing)."""
  try:
    import triton
    from triton.backends.compiler import GPUTarget
  except ImportError as e:
    raise ImportError("kernel_sass needs the triton package (pip install triton==3.6.0), which bundles ptxas and "
                      "cuobjdump; the project itself does not depend on it") from e
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "kernel")
    with open(path + ".ttir", "w") as f:
      f.write(module.ir)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    try:
      compiled = triton.compile(path + ".ttir", target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": module.num_warps, "num_stages": module.num_stages})
      with open(path + ".cubin", "wb") as f:
        f.write(compiled.asm["cubin"])
      sass, usage = (subprocess.run([cuobjdump, flag, path + ".cubin"], capture_output=True, text=True,
                                    check=True).stdout for flag in ("--dump-sass", "-res-usage"))
    except Exception as e:  # noqa: BLE001 (triton's compile errors have no common base; one message for all)
      raise RuntimeError(f"compiling {module.name} for sm_90 with triton {triton.__version__} failed: "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
  registers = re.search(r"REG:(\d+)", usage)
  if registers is None:
    raise RuntimeError(f"cuobjdump -res-usage named no register count for {module.name}")
  return sass, int(registers.group(1)), int(compiled.metadata.shared)


def hot_loop(sass: str) -> tuple[int, collections.Counter]:
  """``(instructions, opcode counts)`` of the longest loop in ``sass`` (``cuobjdump --dump-sass`` text, one or more
  functions): the span from a backward branch's target to the branch, guarded or not (a branch to itself, the
  padding after EXIT, is no loop). Opcodes without modifiers (``HMMA``, ``LOP3``); a predicate guard does not count
  as the opcode. ``(0, Counter())`` where there is no loop."""
  functions, current = [], []
  for line in sass.splitlines():
    if _FUNCTION.match(line) and current:
      functions.append(current)
      current = []
    found = _SASS_LINE.match(line)
    if found:
      current.append((int(found.group(1), 16), found.group(2).strip()))
  functions.append(current)
  best = []
  for lines in functions:
    for address, text in lines:
      branch = _BRANCH.match(text)
      target = int(branch.group(1), 16) if branch else address
      if target < address:
        body = [t for a, t in lines if target <= a <= address]
        best = body if len(body) > len(best) else best
  ops = collections.Counter()
  for text in best:
    words = text.split()
    opcode = words[1] if words[0].startswith("@") else words[0]
    ops[opcode.split(".")[0]] += 1
  return len(best), ops


def _parse_tiling(text: str) -> tuple[int, int, int, int]:
  parts = tuple(int(v) for v in text.split(","))
  if len(parts) != 4 or any(v <= 0 for v in parts):
    raise argparse.ArgumentTypeError(f"--tiling takes block_n,block_k,num_warps,num_stages, got {text!r}")
  return parts


def w8a16_report(k: int, n: int, tiling: tuple[int, int, int, int] | None = None) -> dict:
  """The hot loop of the W8A16 kernel at M = 1 on a ``[N, K]`` weight (its shipped tiling, or ``tiling``)."""
  from pallas_kernels import w8a16

  config = w8a16.config_for(1, n, k)
  if tiling is not None:
    block_n, block_k, warps, stages = tiling
    config = dataclasses.replace(config, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages)
    config = dataclasses.replace(config, split_k=config.split_rule.split_k(n // block_n, k, block_k))
  if not w8a16.supports(n, k, config):
    raise ValueError(f"the W8A16 kernel does not tile [N={n}, K={k}] with {config}")
  args = (jax.ShapeDtypeStruct((1, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.int8),
          jax.ShapeDtypeStruct((n,), jnp.float32))
  [module] = triton_modules(functools.partial(w8a16.w8a16_matmul_kernel, config=config), *args)
  sass, registers, shared = compile_sass(module)
  count, ops = hot_loop(sass)
  per_thread = config.block_n * config.block_k / (32 * config.num_warps)  # weights a thread converts a step
  return {"k": k, "n": n, "config": str(config), "loop_instructions": count, "weights_per_thread": per_thread,
          "instructions_per_weight": count / per_thread, "registers": registers, "shared_bytes": shared,
          "ops": dict(ops.most_common())}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--k", type=int, default=2048)
  parser.add_argument("--n", type=int, default=16384)
  parser.add_argument("--tiling", type=_parse_tiling, help="block_n,block_k,num_warps,num_stages (default: shipped)")
  parser.add_argument("--out", help="write the report as JSON here (benchmarks.common.write_json)")
  args = parser.parse_args(argv)
  try:
    report = w8a16_report(args.k, args.n, args.tiling)
  except (ImportError, ValueError, RuntimeError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"W8A16 M=1 [N={report['n']}, K={report['k']}]: {report['config']}")
  print(f"hot loop: {report['loop_instructions']} instructions a K step, {report['weights_per_thread']:.0f} weights a "
        f"thread -> {report['instructions_per_weight']:.2f} instructions a weight; {report['registers']} registers, "
        f"{report['shared_bytes']} bytes of shared memory")
  print("  " + "  ".join(f"{op} {count}" for op, count in report["ops"].items()))
  if args.out:
    import triton

    from benchmarks.common import write_json

    print(f"wrote {write_json('kernel_sass', [report], args.out, triton=triton.__version__, target='sm_90')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
