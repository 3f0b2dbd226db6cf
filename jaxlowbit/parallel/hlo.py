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

:func:`bytes_by_axis` names the axes: it places a collective's first replica group (logical device
ids, which follow ``mesh.devices.flat`` in a ``jit`` / ``shard_map`` program) on the mesh and
reports bytes per step per mesh axis, op and element type, e.g. ``{"fsdp": {"all-gather": {"u8":
...}, "reduce-scatter": {"bf16": ...}}, "tensor": {...}}``.

An asynchronous collective XLA wraps in ``async-start`` / ``async-done`` (reduce-scatter,
all-to-all on GPUs) names its wrapped computation from both instructions; only the start's call
counts, so such a collective is counted once per run (not once per start and once per done).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

import numpy as np

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
# replica_groups={{0,1},{2,3}} (explicit) or replica_groups=[4,2]<=[8] / [2,4]<=[4,2]T(1,0) (iota: the device
# ids 0..n-1 laid out as dims, transposed by perm, read as groups x size).
_GROUPS = re.compile(r"replica_groups=(?:\{\{(?P<first>[\d,]*)\}|\[(?P<count>\d+),(?P<size>\d+)\]<=\[(?P<dims>[\d,]+)\]"
                     r"(?:T\((?P<perm>[\d,]+)\))?)")
_PAIRS = re.compile(r"source_target_pairs=\{\{(?P<first>\d+,\d+)\}")  # a permute's first (source, target)
_ASYNC_END = re.compile(r"\sasync-(?:done|update)\(")  # names the wrapped computation again: not a second call


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction: ``op`` (e.g. ``"all-gather"``) and its result arrays ``(dtype, shape)``."""

  op: str
  results: tuple[tuple[str, tuple[int, ...]], ...]
  executions: int = 1  # per run of the program (loop trip counts; 1 outside loops)
  group_size: int | None = None  # devices per replica group (None: not stated, e.g. all devices)
  group: tuple[int, ...] | None = None  # logical device ids of the first replica group (a permute: its first pair)

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


def _first_group(line: str) -> tuple[int, ...] | None:
  """Logical device ids of the first replica group named on ``line`` (a permute: its first pair), or None."""
  groups = _GROUPS.search(line)
  if groups and groups["first"] is not None:
    return tuple(int(v) for v in groups["first"].split(",") if v)
  if groups:
    dims = [int(v) for v in groups["dims"].split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if groups["perm"]:
      ids = ids.transpose([int(v) for v in groups["perm"].split(",")])
    return tuple(int(v) for v in ids.reshape(int(groups["count"]), int(groups["size"]))[0])
  pairs = _PAIRS.search(line)
  return tuple(int(v) for v in pairs["first"].split(",")) if pairs else None


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective in ``hlo_text`` (``Compiled.as_text()``), in order of appearance.

  A while loop without a known trip count counts its body once.
  """
  found: list[tuple[str, str, tuple, int | None, tuple | None]] = []  # (computation, op, results, group size, group)
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
    for callee in () if _ASYNC_END.search(line) else _CALLEES.finditer(line):
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
    group = _first_group(line)
    group_size = len(group) if group is not None and _GROUPS.search(line) else None
    if arrays:
      found.append((current, match["op"], tuple(arrays), group_size, group))

  memo: dict[str, int] = {}

  def executions(name: str, seen: frozenset = frozenset()) -> int:
    if name == entry or name not in calls:
      return 1
    if name in seen:  # malformed recursion: count once
      return 1
    if name not in memo:
      memo[name] = sum(times * executions(caller, seen | {name}) for caller, times in calls[name])
    return memo[name]

  return [Collective(op, results, executions(comp), size, group) for comp, op, results, size, group in found]


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


def mesh_axes(group: tuple[int, ...] | None, axis_sizes: Mapping[str, int]) -> str:
  """The mesh axes a replica group spans, ``"+"``-joined in mesh order (``"fsdp"``, ``"data+fsdp"``).

  Args:
    group: logical device ids (:attr:`Collective.group`; ``mesh.devices.flat`` order), or None for a
      collective over all devices.
    axis_sizes: the mesh's ``{axis name: size}`` in mesh order (``dict(mesh.shape)``).
  Returns:
    the axes along which the group's devices differ; ``"none"`` for a group of one device.
  """
  names, sizes = list(axis_sizes), list(axis_sizes.values())
  if group is None:
    varying = [name for name, size in zip(names, sizes) if size > 1]
  else:
    coords = np.array(np.unravel_index(np.asarray(group), sizes)).T  # [devices, axes]
    varying = [name for i, name in enumerate(names) if len(set(coords[:, i])) > 1]
  return "+".join(varying) or "none"


def bytes_by_axis(found: list[Collective], axis_sizes: Mapping[str, int]) -> dict[str, dict[str, dict[str, int]]]:
  """``{mesh axes: {op: {element type: bytes per run}}}`` of ``found`` on a mesh of ``axis_sizes``
  (:func:`mesh_axes` names the axes; bytes as :attr:`Collective.bytes_per_run` counts them: each
  device's results, loops counted)."""
  table: dict[str, dict[str, dict[str, int]]] = {}
  for c in found:
    per_op = table.setdefault(mesh_axes(c.group, axis_sizes), {}).setdefault(c.op, {})
    for dtype, shape in c.results:
      per_op[dtype] = per_op.get(dtype, 0) + math.prod(shape) * element_bytes(dtype) * c.executions
  return table


__all__ = ["COLLECTIVE_OPS", "Collective", "bytes_by_axis", "collectives", "element_bytes", "mesh_axes", "summarize"]
