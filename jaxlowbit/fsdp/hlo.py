"""The collectives of a compiled XLA program: what FSDP's tests and benchmark count.

``collectives(jax.jit(f).lower(*args).compile().as_text())`` lists every all-gather,
all-reduce, reduce-scatter, all-to-all and collective-permute instruction with its result
arrays, in program order, whether XLA emitted it synchronously (``all-gather(``) or
asynchronously (``all-gather-start(``; an op wrapped in ``async-start`` shows as its
synchronous form inside the wrapped computation), and whether XLA combined several into
one instruction (a tuple of results).
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
  """One collective instruction: ``op`` (e.g. ``"all-gather"``) and its result arrays ``(dtype, shape)``."""

  op: str
  results: tuple[tuple[str, tuple[int, ...]], ...]

  @property
  def dtype(self) -> str:
    """Element type of the (single, or every) result."""
    dtypes = {d for d, _ in self.results}
    if len(dtypes) != 1:
      raise ValueError(f"{self.op} has results of several types {sorted(dtypes)}")
    return dtypes.pop()

  @property
  def shape(self) -> tuple[int, ...]:
    """Shape of the single result (ValueError for a combined collective)."""
    if len(self.results) != 1:
      raise ValueError(f"{self.op} combines {len(self.results)} results")
    return self.results[0][1]

  @property
  def bytes(self) -> int:
    """Bytes of the results (for an all-gather: what every device receives, its own shard included)."""
    return sum(math.prod(shape) * element_bytes(dtype) for dtype, shape in self.results)


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
    arrays = [(d, tuple(int(v) for v in dims.split(",") if v)) for d, dims in _ARRAY.findall(match["type"])]
    if match["start"] and match["op"] == "all-gather":
      arrays = arrays[len(arrays) // 2 :]  # (operands..., results...)
    elif match["start"] and match["op"] == "collective-permute":
      arrays = arrays[1:2]  # (operand, result, contexts...)
    if arrays:
      found.append(Collective(match["op"], tuple(arrays)))
  return found


__all__ = ["COLLECTIVE_OPS", "Collective", "collectives", "element_bytes"]
