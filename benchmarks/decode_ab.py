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
a policy, a tiling) or ``module.ATTRIBUTE.FIELD=VALUE`` (one field of a frozen dataclass constant, replaced with
``dataclasses.replace``); VALUE is a Python literal (``2048``, ``False``, ``(8, 2048)``, ``'cvt'``). The settings
hold while the variant's rows run and are restored after. JAX's caches are cleared between variants, so every
variant traces and compiles afresh and reads the constants as set. A setting replaces the attribute of that
module only: code that copied a value at import (``from module import NAME``) keeps the old one, so set it where it
is read.

Each row is ``benchmarks.inference.bench_decode``'s (median of ``--runs`` >= 5 timed runs of ``--new-tokens - 1``
decode steps after a ``--prompt-len`` prompt, random weights) with its variant and round; the ``--baseline``
scheme (bf16 weights) runs once first, under no settings, and each row's ``speedup`` is against it at the same
batch. The table printed last gives every row, then each variant's median over its rounds and its range.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import statistics
import time
from typing import Any

import jax

from benchmarks.common import table, write_json
from benchmarks.inference import DECODE_CONFIGS, MIN_RUNS, bench_decode


@dataclasses.dataclass(frozen=True)
class Setting:
  """``module.attribute`` (and ``field`` of the dataclass it holds) set to ``value``."""

  module: Any
  attribute: str
  field: str | None
  value: Any
  text: str

  def current(self):
    held = getattr(self.module, self.attribute)
    return held if self.field is None else getattr(held, self.field)

  def replaced(self, value):
    """The attribute's new value: ``value``, or the dataclass with its field replaced by it."""
    if self.field is None:
      return value
    return dataclasses.replace(getattr(self.module, self.attribute), **{self.field: value})


def parse_setting(text: str) -> Setting:
  """``module.ATTRIBUTE[.FIELD]=VALUE`` -> :class:`Setting`; ValueError naming what is wrong."""
  path, sep, literal = text.partition("=")
  if not sep or not path or not literal:
    raise ValueError(f"setting {text!r}: expected module.ATTRIBUTE=VALUE or module.ATTRIBUTE.FIELD=VALUE")
  try:
    value = ast.literal_eval(literal)
  except (ValueError, SyntaxError):
    raise ValueError(f"setting {text!r}: the value {literal!r} is not a Python literal") from None
  parts = path.split(".")
  for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
    try:
      module = importlib.import_module(".".join(parts[:cut]))
    except ImportError:
      continue
    names = parts[cut:]
    if len(names) > 2:
      raise ValueError(f"setting {text!r}: {'.'.join(names)} is nested deeper than ATTRIBUTE.FIELD")
    if not hasattr(module, names[0]):
      raise ValueError(f"setting {text!r}: module {module.__name__} has no attribute {names[0]!r}")
    field = names[1] if len(names) == 2 else None
    held = getattr(module, names[0])
    if field is not None and not (dataclasses.is_dataclass(held)
                                  and field in {f.name for f in dataclasses.fields(held)}):
      raise ValueError(f"setting {text!r}: {module.__name__}.{names[0]} is not a dataclass with a field {field!r}")
    return Setting(module, names[0], field, value, text)
  raise ValueError(f"setting {text!r}: no importable module in {path!r}")


def parse_variant(text: str) -> tuple[str, tuple[Setting, ...]]:
  """``NAME`` or ``NAME=SETTING;SETTING...`` -> (name, settings)."""
  name, _, rest = text.partition("=")
  if not name.isidentifier():
    raise ValueError(f"variant {text!r}: its name {name!r} must be an identifier (NAME=SETTING;...)")
  return name, tuple(parse_setting(s) for s in rest.split(";") if s) if rest else ()


@contextlib.contextmanager
def applied(settings: tuple[Setting, ...]):
  """The settings in force (JAX's caches cleared, so what is traced next reads them); restored after, in reverse."""
  saved = []
  try:
    for s in settings:
      saved.append((s, getattr(s.module, s.attribute)))
      setattr(s.module, s.attribute, s.replaced(s.value))
    jax.clear_caches()
    yield
  finally:
    for s, old in reversed(saved):
      setattr(s.module, s.attribute, old)
    jax.clear_caches()


def run_order(names: list[str], rounds: int) -> list[tuple[int, str]]:
  """``(round, variant)`` in run order: odd rounds in the order given, even rounds reversed."""
  return [(r + 1, name) for r in range(rounds) for name in (names if r % 2 == 0 else names[::-1])]


def summarize(rows: list[dict]) -> list[dict]:
  """Per (variant, scheme, batch): the median tokens/s over rounds, its min and max, and the median speedup."""
  out = []
  for key in dict.fromkeys((r["variant"], r["scheme"], r["batch"]) for r in rows if r.get("round")):
    mine = [r for r in rows if (r["variant"], r["scheme"], r["batch"]) == key and r.get("tokens_per_s")]
    if not mine:
      continue
    rates = [r["tokens_per_s"] for r in mine]
    speedups = [r["speedup"] for r in mine if r.get("speedup")]
    out.append({"variant": key[0], "scheme": key[1], "batch": key[2], "rounds": len(mine),
                "tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
                "speedup": statistics.median(speedups) if speedups else None})
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--variant", action="append", required=True, dest="variants",
                      help="NAME or NAME=module.ATTRIBUTE[.FIELD]=VALUE;... (repeat; the first: the shipped code)")
  parser.add_argument("--scheme", default="ternary", help="bf16, w8a16, w8a8 or ternary")
  parser.add_argument("--batches", type=int, nargs="+", default=[1])
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--baseline", default="bf16", help="scheme run once first, under no settings ('' for none)")
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
    variants = dict(parse_variant(v) for v in args.variants)
  except ValueError as e:
    parser.error(str(e))
  if len(variants) != len(args.variants):
    parser.error(f"--variant names repeat: {[parse_variant(v)[0] for v in args.variants]}")

  config = DECODE_CONFIGS[args.config]
  start = time.perf_counter()
  rows: list[dict] = []

  def measure(scheme: str, tags: dict) -> None:
    for row in bench_decode(config, [scheme], args.batches, args.prompt_len, args.new_tokens, args.runs):
      rows.append({**tags, **row})
    write_json("decode_ab", rows, args.out, partial=True)  # a call cut by its time limit keeps its rows

  if args.baseline:
    measure(args.baseline, {"variant": "baseline", "round": 0})
  for round_, name in run_order(list(variants), args.rounds):
    with applied(variants[name]):
      measure(args.scheme, {"variant": name, "round": round_})
  for row in rows:
    base = next((b["tokens_per_s"] for b in rows if b["variant"] == "baseline" and b.get("tokens_per_s")
                 and b["batch"] == row.get("batch")), None)
    if base and row.get("tokens_per_s") and row["variant"] != "baseline":
      row["speedup"] = row["tokens_per_s"] / base
  summary = summarize(rows)
  path = write_json("decode_ab", rows, args.out, summary=summary,
                    variants={name: [s.text for s in settings] for name, settings in variants.items()},
                    seconds=time.perf_counter() - start)
  print("\nrows, in the order run (speedup against the baseline at the same batch):")
  print(table(rows, ["round", "variant", "scheme", "batch", "tokens_per_s", "spread", "speedup", "error"]))
  print("\nper variant over its rounds (median tokens/s, min, max):")
  print(table(summary, ["variant", "scheme", "batch", "rounds", "tokens_per_s", "min", "max", "speedup"]))
  print(f"\nwrote {path}")


if __name__ == "__main__":
  main()
