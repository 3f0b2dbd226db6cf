"""Where the Pallas int8 quantizer's codes differ from XLA's, per division form (``policy.INT8_DIVISION``).

    PYTHONPATH=. python benchmarks/quantizer_agreement.py --out benchmarks/results/quantizer_agreement_h200.json
    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/quantizer_agreement.py --smoke   # CPU, interpret mode

On a GPU the kernels' int8 codes differ from XLA's reference (``quantize_rows_reference``) in a few elements:
``tests/test_kernels_gpu.py`` allows under 1e-4 of them, and a W8A8 decode fed the norm kernel's codes did not
reproduce XLA's logits (``policy.W8A8_DECODE_CODES``). For each form of ``x / scale`` in the kernels
(``reciprocal``: Triton's float32 ``1 / scale``, shipped; ``rcp_rn`` and ``div_rn``: PTX's correctly rounded
reciprocal or quotient), this counts, over ``--draws`` random inputs, the codes that differ from XLA's for

- ``rows``: the rows quantizer (``quantize_rows_kernel``; one scale a row), on ``[256, 1536]`` bf16 as the GPU
  test draws it;
- ``norm``: the decode norm that writes codes (``norm_rows_kernel``; one scale a program), at the 1B model's
  widths, against XLA quantizing the same kernel's bf16 output.

A form with no differing code in every draw is XLA's; the table prints each form's count, fraction and largest
code step. In interpret mode (``--smoke``) every form is XLA's division, so every count must be 0.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import table, write_json  # noqa: E402
from jaxlowbit.inference.weights import INT8_TOKENS  # noqa: E402
from pallas_kernels import decode, policy  # noqa: E402
from pallas_kernels import quantize as quantize_kernels  # noqa: E402
from pallas_kernels.quantize import Identity, RmsNorm  # noqa: E402
from pallas_kernels.reference import quantize_rows_reference  # noqa: E402

NORM_SHAPES = ((1, 2048), (8, 2048), (1, 8192))
ROWS_SHAPE = (256, 1536)
SMOKE_NORM_SHAPES, SMOKE_ROWS_SHAPE = ((1, 256), (4, 256)), (16, 256)


def _differences(got, want) -> tuple[int, int]:
  """(codes that differ, largest code step)."""
  got, want = np.asarray(got, np.int32), np.asarray(want, np.int32)
  return int(np.sum(got != want)), int(np.max(np.abs(got - want), initial=0))


def agreement(form: str, draws: int, interpret: bool, norm_shapes, rows_shape) -> list[dict]:
  """One row per case: the codes of ``form`` that differ from XLA's, over ``draws`` inputs."""
  policy.INT8_DIVISION = form
  jax.clear_caches()  # the kernels trace the form: no cached lowering of another one
  reference = jax.jit(quantize_rows_reference, static_argnums=1)
  norm = RmsNorm(1e-5, jnp.dtype(jnp.bfloat16))
  norm_kernel = jax.jit(lambda x, g: decode.norm_rows_kernel((x,), g, Identity(), norm, quantize=INT8_TOKENS,
                                                             interpret=interpret, keep_values=True))
  rows_kernel = jax.jit(lambda x: quantize_kernels.quantize_rows_kernel(x, INT8_TOKENS, interpret=interpret))
  rows = []
  for case, shape in [("rows", rows_shape)] + [("norm", s) for s in norm_shapes]:
    differing = steps = elements = 0
    for draw in range(draws):
      key = jax.random.fold_in(jax.random.key(sum(shape)), draw)
      x = (jax.random.normal(key, shape, jnp.float32) * 3).astype(jnp.bfloat16)
      if case == "rows":
        codes, _ = rows_kernel(x)
        want, _ = reference(x, INT8_TOKENS)
      else:
        gamma = (1 + 0.1 * jax.random.normal(jax.random.fold_in(key, 1), shape[1:], jnp.float32)).astype(jnp.bfloat16)
        codes, _, y = norm_kernel(x, gamma)
        want, _ = reference(y, INT8_TOKENS)  # XLA quantizing the kernel's own bf16 output
      n, step = _differences(codes, want)
      differing, steps, elements = differing + n, max(steps, step), elements + x.size
    rows.append({"form": form, "case": case, "shape": "x".join(map(str, shape)), "draws": draws,
                 "elements": elements, "differing": differing, "fraction": differing / elements,
                 "max_step": steps})
  return rows


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--draws", type=int, default=8)
  parser.add_argument("--forms", nargs="*", default=list(policy.INT8_DIVISIONS), choices=policy.INT8_DIVISIONS)
  parser.add_argument("--smoke", action="store_true", help="interpret mode on small shapes (CPU)")
  parser.add_argument("--out")
  args = parser.parse_args(argv)
  interpret = args.smoke or jax.default_backend() != "gpu"
  shipped = policy.INT8_DIVISION
  rows = []
  try:
    for form in args.forms:
      try:
        rows += agreement(form, 2 if args.smoke else args.draws, interpret,
                          SMOKE_NORM_SHAPES if args.smoke else NORM_SHAPES,
                          SMOKE_ROWS_SHAPE if args.smoke else ROWS_SHAPE)
      except Exception as e:  # a form that fails to compile is a row too
        rows.append({"form": form, "error": f"{type(e).__name__}: {str(e)[:300]}"})
  finally:
    policy.INT8_DIVISION = shipped
  path = write_json("quantizer_agreement", rows, args.out, interpret=interpret)
  print(table(rows, ["form", "case", "shape", "elements", "differing", "fraction", "max_step", "error"]))
  print(f"wrote {path}")
  return rows


if __name__ == "__main__":
  main()
