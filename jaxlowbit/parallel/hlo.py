"""The collectives of a compiled XLA program: what FSDP's tests and benchmarks count.

``collectives(jax.jit(f).lower(*args).compile().as_text())`` lists every all-gather,
all-reduce, reduce-scatter, all-to-all and collective-permute instruction with its result
arrays and how many times one run of the program executes it (the product of the known
trip counts of the while loops around it, e.g. ``nn.scan`` over layers), in program order;
whether XLA emitted it synchronously (``all-gather(``) or asynchronously
(``all-gather-start(``; an op wrapped in ``async-start`` shows as its synchronous form
inside the wrapped computation), and whether XLA combined several into one instruction
(a tuple of results), and how many devices each of its replica groups holds (which mesh axis it
runs over: with FSDP 4 x tensor 2, the tensor axis's groups hold 2 devices).
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
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_CALLEES = re.compile(r"(?P<key>body|calls|to_apply|condition|true_computation|false_computation)=%?(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')
# replica_groups={{0,1},{2,3}} (explicit) or replica_groups=[4,2]<=[8] (iota: 4 groups of 2).
_GROUPS = re.compile(r"replica_groups=(?:\{\{(?P<first>[\d,]*)\}|\[\d+,(?P<size>\d+)\]<=)")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction: ``op`` (e.g. ``"all-gather"``) and its result arrays ``(dtype, shape)``."""

  op: str
  results: tuple[tuple[str, tuple[int, ...]], ...]
  executions: int = 1  # per run of the program (loop trip counts; 1 outside loops)
  group_size: int | None = None  # devices per replica group (None: not stated, e.g. all devices)

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
    """Bytes of the results of one execution (all-gather: what every device receives, own shard included)."""
    return sum(math.prod(shape) * element_bytes(dtype) for dtype, shape in self.results)

  @property
  def bytes_per_run(self) -> int:
    return self.bytes * self.executions


def element_bytes(dtype: str) -> int:
  if dtype.startswith("f8"):
    return 1
  try:
    return _ELEMENT_BYTES[dtype]
  except KeyError:
    raise ValueError(f"unknown XLA element type {dtype!r}") from None


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective in ``hlo_text`` (``Compiled.as_text()``), in order of appearance.

  A while loop without a known trip count counts its body once.
  """
  found: list[tuple[str, str, tuple, int | None]] = []  # (computation, op, results, group size)
  calls: dict[str, list[tuple[str, int]]] = {}  # callee -> [(caller, times per caller run)]
  entry, current = None, None
  for line in hlo_text.splitlines():
    if line.startswith("}"):
      current = None
      continue
    header = _COMPUTATION.match(line) if current is None else None
    if header:
      current = header["name"]
      if line.startswith("ENTRY"):
        entry = current
      continue
    if current is None:
      continue
    trip = _TRIP_COUNT.search(line)
    for callee in _CALLEES.finditer(line):
      times = int(trip["n"]) if trip and callee["key"] == "body" else 1
      calls.setdefault(callee["name"], []).append((current, times))
    branches = _BRANCHES.search(line)
    for name in branches["names"].split(",") if branches else ():
      calls.setdefault(name.strip().lstrip("%"), []).append((current, 1))
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    arrays = [(d, tuple(int(v) for v in dims.split(",") if v)) for d, dims in _ARRAY.findall(match["type"])]
    if match["start"] and match["op"] == "all-gather":
      arrays = arrays[len(arrays) // 2 :]  # (operands..., results...)
    elif match["start"] and match["op"] == "collective-permute":
      arrays = arrays[1:2]  # (operand, result, contexts...)
    groups = _GROUPS.search(line)
    group_size = None
    if groups:
      group_size = int(groups["size"]) if groups["size"] else len(groups["first"].split(","))
    if arrays:
      found.append((current, match["op"], tuple(arrays), group_size))

  memo: dict[str, int] = {}

  def executions(name: str, seen: frozenset = frozenset()) -> int:
    if name == entry or name not in calls:
      return 1
    if name in seen:  # malformed recursion: count once
      return 1
    if name not in memo:
      memo[name] = sum(times * executions(caller, seen | {name}) for caller, times in calls[name])
    return memo[name]

  return [Collective(op, results, executions(comp), size) for comp, op, results, size in found]


def summarize(found: list[Collective], by_group: bool = False) -> dict[str, dict]:
  """Per collective op (``by_group``: per op and replica group size, ``"all-gather/2"``): its
  instructions, executions and bytes per run of the program (loops counted), and element types."""
  summary: dict[str, dict] = {}
  for c in found:
    key = f"{c.op}/{c.group_size or 'all'}" if by_group else c.op
    entry = summary.setdefault(key, {"instructions": 0, "count": 0, "bytes": 0, "dtypes": set()})
    entry["instructions"] += 1
    entry["count"] += c.executions
    entry["bytes"] += c.bytes_per_run
    entry["dtypes"].update(dtype for dtype, _ in c.results)
  return {key: {**e, "dtypes": sorted(e["dtypes"])} for key, e in summary.items()}


__all__ = ["COLLECTIVE_OPS", "Collective", "collectives", "element_bytes", "summarize"]
