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
kernel's start. On the W8A16 kernel (1B gate_up, the shipped tiling) it shows 279 instructions a K step, 4.4 a
weight a thread: 2 of them convert int8 to bf16 (PRMT, two LOP3, HADD2 per pair), about 1.3 move the masked x tile
into mma operands (IMAD.MOV, LDS), 0.25 are HMMA. At the H200's issue rate that is ~7.7 T weights/s, 2.7x what the
kernel streams (2.8 TB/s): it waits on latency, not on issue slots (docs/inference.md).

The tool drives :func:`pallas_kernels.w8a16.w8a16_matmul_kernel` at M = 1; :func:`triton_modules`,
:func:`compile_sass` and :func:`hot_loop` take any jitted function and any SASS.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

_SASS_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRANCH = re.compile(r"^@!?U?P\w+\s+BRA\s+(0x[0-9a-f]+)")
_LAUNCH = re.compile(r"num_stages = (\d+) : i32, num_warps = (\d+) : i32")


@dataclasses.dataclass(frozen=True)
class TritonModule:
  """One ``pallas_call`` as XLA receives it: the Triton IR (text) and its launch parameters."""

  name: str
  ir: str
  num_warps: int
  num_stages: int


def triton_modules(fn, *args) -> list[TritonModule]:
  """The Triton modules of every ``pallas_call`` in ``jax.jit(fn)(*args)`` (``args``: arrays or
  ``jax.ShapeDtypeStruct``), lowered for CUDA on whatever machine this runs.

  Reads the modules where JAX's Pallas Triton lowering makes them (``lower_jaxpr_to_triton_module``, a private
  function of jax 0.10-0.11); raises RuntimeError if that function is gone."""
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
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = original
  launches = _LAUNCH.findall(text)
  if len(launches) != len(irs):
    raise RuntimeError(f"found {len(irs)} Triton modules but {len(launches)} launch configurations in the lowering")
  names = [re.search(r"tt\.func public @(\S+?)\(", ir).group(1) for ir in irs]
  return [TritonModule(name, ir, int(warps), int(stages))
          for name, ir, (stages, warps) in zip(names, irs, launches)]


def compile_sass(module: TritonModule, workdir: str | None = None) -> tuple[str, int, int]:
  """``(sass, registers a thread, shared memory bytes)`` of ``module`` compiled for sm_90 by the ``triton``
  package (ImportError naming the install if it is missing)."""
  try:
    import triton
    from triton.backends.compiler import GPUTarget
  except ImportError as e:
    raise ImportError("kernel_sass needs the triton package (pip install triton==3.6.0), which bundles ptxas and "
                      "cuobjdump; the project itself does not depend on it") from e
  with tempfile.TemporaryDirectory(dir=workdir) as tmp:
    path = os.path.join(tmp, module.name)
    with open(path + ".ttir", "w") as f:
      f.write(module.ir)
    compiled = triton.compile(path + ".ttir", target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": module.num_warps, "num_stages": module.num_stages})
    with open(path + ".cubin", "wb") as f:
      f.write(compiled.asm["cubin"])
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    sass = subprocess.run([cuobjdump, "--dump-sass", path + ".cubin"], capture_output=True, text=True,
                          check=True).stdout
    usage = subprocess.run([cuobjdump, "-res-usage", path + ".cubin"], capture_output=True, text=True,
                           check=True).stdout
  registers = int(re.search(r"REG:(\d+)", usage).group(1))
  return sass, registers, int(compiled.metadata.shared)


def hot_loop(sass: str) -> tuple[int, collections.Counter]:
  """``(instructions, opcode counts)`` of the longest loop in ``sass`` (``cuobjdump --dump-sass`` text): the span
  from a backward conditional branch's target to the branch. Opcodes without modifiers (``HMMA``, ``LOP3``); a
  predicate guard does not count as the opcode. ``(0, Counter())`` where there is no loop."""
  lines = [(int(m.group(1), 16), m.group(2).strip()) for m in map(_SASS_LINE.match, sass.splitlines()) if m]
  loop = None
  for address, text in lines:
    branch = _BRANCH.match(text)
    if branch and int(branch.group(1), 16) < address:
      target = int(branch.group(1), 16)
      if loop is None or address - target > loop[1] - loop[0]:
        loop = (target, address)
  if loop is None:
    return 0, collections.Counter()
  body = [text for address, text in lines if loop[0] <= address <= loop[1]]
  ops = collections.Counter()
  for text in body:
    words = text.split()
    opcode = words[1] if words[0].startswith("@") else words[0]
    ops[opcode.split(".")[0]] += 1
  return len(body), ops


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
  [module] = triton_modules(lambda x, w, s: w8a16.w8a16_matmul_kernel(x, w, s, config=config), *args)
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
  return 0


if __name__ == "__main__":
  sys.exit(main())
