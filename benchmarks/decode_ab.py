"""Decode A/B: the ~1B decode under named settings, in alternating rounds of one process.

    PYTHONPATH=. python -m benchmarks.decode_ab --scheme ternary --batches 1 --rounds 2 \\
        --variant shipped \\
        --variant "one_step=pallas_kernels.dp4a_gemv.CODES_LONG_K_TILING.block_k=2048" \\
        --variant "no_gate=pallas_kernels.policy.GATED_EPILOGUE=False" \\
        --out benchmarks/results/decode_ab_h200.json

Why one process: two processes running the same code have differed by up to 4% in decode tokens/s
(docs/inference.md), more than most changes worth measuring. Rows measured in one process, in alternating order
(round 1 in the order given, round 2 reversed, ...), compare.

A variant is ``NAME`` or ``NAME=SETTING;SETTING...``. A setting is ``module.ATTRIBUTE=VALUE`` (a module constant:
a policy, a tiling) or ``module.ATTRIBUTE.FIELD=VALUE`` (one field of a frozen dataclass instance, replaced with
``dataclasses.replace``); VALUE is a Python literal of the current value's type (``2048``, ``False``, ``(8,
2048)``, ``'cvt'``; an int where a float is held). The settings hold while the variant's rows run and are restored
after, in reverse order (also when a row fails). JAX's caches are cleared between variants, so each variant traces
and compiles afresh.

A setting replaces one module attribute, and takes effect only where code reads that attribute when it traces. It
changes nothing where the value was copied when a module was imported:

- ``from module import NAME`` elsewhere (``pallas_kernels.inference_dispatch`` holds its own ``A8W2_BASE``,
  ``A8W8_BASE`` and ``ACTIVATION_DTYPES``; ``pallas_kernels.int8_gemv`` its ``MIN_BLOCK_M``);
- constants built from others at import (``dp4a_gemv.DECODE_PROGRAMS_PER_SM`` lives on inside every dp4a tiling's
  ``split_rule``; ``int8_gemv.A8W2_PROGRAMS_PER_SM`` inside ``A8W2_BASE``);
- default arguments (``w8a16.PROGRAMS_PER_SM``; ``pallas_kernels.decode.ATTENTION_BLOCK``).

So every row records a hash of its decode step as lowered (``program_sha1``: the step's program with every
kernel's tiling and launch parameters), and a variant whose steps are those of the first variant, at every batch,
is reported (``same_program_as`` in the summary, and a warning line): its settings changed nothing that was
traced.

Each row is ``benchmarks.inference.bench_decode``'s (median of ``--runs`` >= 5 timed runs of ``--new-tokens - 1``
decode steps after a ``--prompt-len`` prompt, random weights) with its variant and round; the ``--baseline``
scheme (bf16 weights) runs once first, under no settings, and each row's ``speedup`` is against it at the same
batch (the baseline runs at the start only, so the ratios carry any drift over the run; the rounds do not). The
output (``--out``) is rewritten after every row; the table printed last gives every row, then each variant's
median over its rounds and its range.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import numbers
import statistics
import time
from typing import Any

import jax

from benchmarks.common import table, write_json
from benchmarks.inference import DECODE_CONFIGS, MIN_RUNS, bench_decode
from jaxlowbit.inference import SCHEMES

DECODE_SCHEMES = ("bf16", *SCHEMES)
BASELINE = "baseline"  # the variant name of the baseline rows


@dataclasses.dataclass(frozen=True)
class Setting:
  """``module.attribute`` (and ``field`` of the dataclass it holds) set to ``value``."""

  module: Any
  attribute: str
  field: str | None
  value: Any
  text: str

  def target(self) -> tuple[str, str, str | None]:
    return self.module.__name__, self.attribute, self.field

  def replaced(self):
    """The attribute's new value: ``value``, or the dataclass it holds now with ``field`` replaced by it."""
    if self.field is None:
      return self.value
    return dataclasses.replace(getattr(self.module, self.attribute), **{self.field: self.value})


def _import(name: str):
  """The module ``name``, or None where no such module exists; ValueError where it exists but fails to import."""
  try:
    return importlib.import_module(name)
  except Exception as e:
    missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
    if missing is not None and (name == missing or name.startswith(missing + ".")):
      return None
    raise ValueError(f"importing {name} failed: {type(e).__name__}: {e}") from None


def _same_kind(value, current) -> bool:
  """Whether ``value`` may replace ``current``: the same type, or numbers where a float is held, or ``current``
  None."""
  if current is None or type(value) is type(current):
    return True
  return (isinstance(value, numbers.Real) and not isinstance(value, bool) and isinstance(current, float))


def parse_setting(text: str) -> Setting:
  """``module.ATTRIBUTE[.FIELD]=VALUE`` -> :class:`Setting`; ValueError naming what is wrong."""
  path, sep, literal = text.partition("=")
  if not sep or not path or not literal:
    raise ValueError(f"setting {text!r}: expected module.ATTRIBUTE=VALUE or module.ATTRIBUTE.FIELD=VALUE")
  parts = path.split(".")
  if not all(part.isidentifier() for part in parts) or len(parts) < 2:
    raise ValueError(f"setting {text!r}: {path!r} is not a dotted path module.ATTRIBUTE[.FIELD]")
  try:
    value = ast.literal_eval(literal)
  except (ValueError, SyntaxError):
    raise ValueError(f"setting {text!r}: the value {literal!r} is not a Python literal") from None
  for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
    try:
      module = _import(".".join(parts[:cut]))
    except ValueError as e:
      raise ValueError(f"setting {text!r}: {e}") from None
    if module is None:
      continue
    names = parts[cut:]
    if not hasattr(module, names[0]):
      raise ValueError(f"setting {text!r}: module {module.__name__} has no attribute {names[0]!r}")
    if len(names) > 2:
      raise ValueError(f"setting {text!r}: {'.'.join(names)} is nested deeper than ATTRIBUTE.FIELD")
    held = getattr(module, names[0])
    field = names[1] if len(names) == 2 else None
    if field is not None:
      if isinstance(held, type) or not dataclasses.is_dataclass(held) or field not in {
          f.name for f in dataclasses.fields(held)}:
        raise ValueError(f"setting {text!r}: {module.__name__}.{names[0]} is not a dataclass instance with a field "
                         f"{field!r}")
      held = getattr(held, field)
    if not _same_kind(value, held):
      raise ValueError(f"setting {text!r}: {value!r} is a {type(value).__name__}, where {path} holds a "
                       f"{type(held).__name__} ({held!r})")
    return Setting(module, names[0], field, value, text)
  raise ValueError(f"setting {text!r}: no importable module in {path!r}")


def parse_variant(text: str) -> tuple[str, tuple[Setting, ...]]:
  """``NAME`` or ``NAME=SETTING;SETTING...`` -> (name, settings); ValueError naming what is wrong."""
  name, _, rest = text.partition("=")
  if not name.isidentifier():
    raise ValueError(f"variant {text!r}: its name {name!r} must be an identifier (NAME=SETTING;...)")
  if name == BASELINE:
    raise ValueError(f"variant {text!r}: {BASELINE!r} names the baseline rows; choose another name")
  settings = tuple(parse_setting(s) for s in rest.split(";") if s) if rest else ()
  targets = [s.target() for s in settings]
  repeated = sorted({".".join(t for t in target if t) for target in targets if targets.count(target) > 1})
  if repeated:
    raise ValueError(f"variant {name!r}: {', '.join(repeated)} set more than once")
  return name, settings


@contextlib.contextmanager
def applied(settings: tuple[Setting, ...]):
  """The settings in force (JAX's caches cleared, so what is traced next reads them); restored after, in reverse."""
  saved = []
  try:
    for s in settings:
      saved.append((s, getattr(s.module, s.attribute)))
      setattr(s.module, s.attribute, s.replaced())
    jax.clear_caches()
    yield
  finally:
    for s, old in reversed(saved):
      setattr(s.module, s.attribute, old)
    jax.clear_caches()


def run_order(names: list[str], rounds: int) -> list[tuple[int, str]]:
  """``(round, variant)`` in run order: odd rounds in the order given, even rounds reversed."""
  return [(r + 1, name) for r in range(rounds) for name in (names if r % 2 == 0 else names[::-1])]


def with_speedups(rows: list[dict]) -> list[dict]:
  """The rows, each measured one (not the baseline) with ``speedup`` against the baseline row of its batch."""
  base = {r.get("batch"): r["tokens_per_s"] for r in rows if r["variant"] == BASELINE and r.get("tokens_per_s")}
  out = []
  for row in rows:
    row = {k: v for k, v in row.items() if k != "speedup"}
    if row["variant"] != BASELINE and row.get("tokens_per_s") and base.get(row.get("batch")):
      row["speedup"] = row["tokens_per_s"] / base[row.get("batch")]
    out.append(row)
  return out


def summarize(rows: list[dict], names: list[str]) -> list[dict]:
  """Per (variant, batch): the median tokens/s over its rounds, min, max and median speedup; ``same_program_as``
  the first variant where every one of its lowered steps is that variant's at the same batch."""
  programs = {}
  for r in rows:
    programs.setdefault((r["variant"], r.get("batch")), set()).add(r.get("program_sha1"))
  out = []
  for key in dict.fromkeys((r["variant"], r.get("batch")) for r in rows if r["variant"] != BASELINE):
    mine = [r for r in rows if (r["variant"], r.get("batch")) == key and r.get("tokens_per_s")]
    if not mine:
      continue
    rates = [r["tokens_per_s"] for r in mine]
    speedups = [r["speedup"] for r in mine if r.get("speedup")]
    entry = {"variant": key[0], "batch": key[1], "rounds": len(mine), "tokens_per_s": statistics.median(rates),
             "min": min(rates), "max": max(rates), "speedup": statistics.median(speedups) if speedups else None}
    first = programs.get((names[0], key[1]), set())
    if key[0] != names[0] and None not in first and programs[key] == first:
      entry["same_program_as"] = names[0]
    out.append(entry)
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--variant", action="append", required=True, dest="variants",
                      help="NAME or NAME=module.ATTRIBUTE[.FIELD]=VALUE;... (repeat; the first: the shipped code)")
  parser.add_argument("--scheme", default="ternary", choices=DECODE_SCHEMES)
  parser.add_argument("--batches", type=int, nargs="+", default=[1])
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--baseline", default="bf16", choices=(*DECODE_SCHEMES, ""),
                      help="scheme run once first, under no settings ('' for none)")
  parser.add_argument("--config", default="1b", choices=list(DECODE_CONFIGS))
  parser.add_argument("--prompt-len", type=int, default=16)
  parser.add_argument("--new-tokens", type=int, default=65, help="decode steps + 1 (the first token is the prefill's)")
  parser.add_argument("--runs", type=int, default=MIN_RUNS, help=f"timed runs per row (>= {MIN_RUNS})")
  parser.add_argument("--out")
  args = parser.parse_args(argv)
  if args.runs < MIN_RUNS:
    parser.error(f"--runs {args.runs}: every figure is the median of at least {MIN_RUNS} runs")
  if args.rounds < 1:
    parser.error(f"--rounds {args.rounds}: at least one")
  try:
    parsed = [parse_variant(v) for v in args.variants]
  except ValueError as e:
    parser.error(str(e))
  names = [name for name, _ in parsed]
  repeated = sorted({name for name in names if names.count(name) > 1})
  if repeated:
    parser.error(f"--variant names repeat: {', '.join(repeated)}")
  variants = dict(parsed)
  described = {name: [s.text for s in settings] for name, settings in variants.items()}

  config = DECODE_CONFIGS[args.config]
  start = time.perf_counter()
  rows: list[dict] = []

  def measure(scheme: str, tags: dict) -> None:
    def save(so_far: list[dict]) -> None:  # after every row: a call cut by its time limit keeps what it measured
      write_json("decode_ab", with_speedups(rows + [{**tags, **r} for r in so_far]), args.out, partial=True,
                 variants=described)

    measured = bench_decode(config, [scheme], args.batches, args.prompt_len, args.new_tokens, args.runs,
                            on_row=save)
    rows.extend({**tags, **r} for r in measured)

  if args.baseline:
    measure(args.baseline, {"variant": BASELINE, "round": 0})
  for round_, name in run_order(names, args.rounds):
    with applied(variants[name]):
      measure(args.scheme, {"variant": name, "round": round_})
  rows = with_speedups(rows)
  summary = summarize(rows, names)
  path = write_json("decode_ab", rows, args.out, summary=summary, variants=described,
                    seconds=time.perf_counter() - start)
  print("\nrows, in the order run (speedup against the baseline at the same batch):")
  print(table(rows, ["round", "variant", "scheme", "batch", "tokens_per_s", "spread", "speedup", "program_sha1",
                     "error"]))
  print("\nper variant over its rounds (median tokens/s, min, max):")
  print(table(summary, ["variant", "batch", "rounds", "tokens_per_s", "min", "max", "speedup", "same_program_as"]))
  for entry in summary:
    if "same_program_as" in entry:
      print(f"warning: variant {entry['variant']} lowered the same decode step as {entry['same_program_as']} at "
            f"batch {entry['batch']}: its settings changed nothing that was traced")
  print(f"\nwrote {path}")


if __name__ == "__main__":
  main()
