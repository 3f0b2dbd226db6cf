"""The collectives of a compiled XLA program: what FSDP's tests and benchmark count.

``collectives(jax.jit(f).lower(*args).compile().as_text())`` lists every all-gather,
all-reduce, reduce-scatter, all-to-all and collective-permute with its result type, in
program order, whether XLA emitted it synchronously (``all-gather(``) or asynchronously
(``all-gather-start(``; an op wrapped in ``async-start`` shows as its synchronous form
inside the wrapped computation).
"""

from __future__ import annotations

import dataclasses
import math
import re

COLLECTIVE_OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
# XLA element type -> bytes; 8-bit floats are all "f8e...".
_ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s+(?P<op>" + "|".join(COLLECTIVE_OPS) + r")(?P<start>-start)?\("
)
_ARRAY = re.compile(r"(?P<dtype>[a-z]\w*)\[(?P<dims>[\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction: ``op`` (e.g. ``"all-gather"``), result ``dtype`` and ``shape``."""

  op: str
  dtype: str
  shape: tuple[int, ...]

  @property
  def bytes(self) -> int:
    """Bytes of the result (for an all-gather: what every device receives, its own shard included)."""
    return math.prod(self.shape) * element_bytes(self.dtype)


def element_bytes(dtype: str) -> int:
  if dtype.startswith("f8"):
    return 1
  try:
    return _ELEMENT_BYTES[dtype]
  except KeyError:
    raise ValueError(f"unknown XLA element type {dtype!r}") from None


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective in ``hlo_text`` (``Compiled.as_text()``), in order of appearance."""
  found = []
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    arrays = _ARRAY.findall(match["type"])
    if not arrays:
      continue
    dtype, dims = arrays[-1]  # an async start's tuple ends with the result
    found.append(Collective(match["op"], dtype, tuple(int(d) for d in dims.split(",") if d)))
  return found


__all__ = ["COLLECTIVE_OPS", "Collective", "collectives", "element_bytes"]
