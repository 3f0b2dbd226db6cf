"""Render benchmarks/results/*.json as markdown tables (for docs/benchmarks.md).

    python benchmarks/report.py gemm_h200 layer_h200 ...   # names of JSON files in benchmarks/results
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS_DIR  # noqa: E402


def _fmt(v) -> str:
  if isinstance(v, float):
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
  return "" if v is None else str(v)


def markdown(name: str, columns: list[str] | None = None) -> str:
  with open(os.path.join(RESULTS_DIR, f"{name}.json")) as f:
    data = json.load(f)
  rows, meta = data["rows"], data["meta"]
  columns = columns or [c for c in rows[0] if not any(c not in r for r in rows[:1])]
  columns = [c for c in columns if any(c in r for r in rows)]
  head = f"`{name}.json`: {meta['device']}, jax {meta['jax']}, {meta['date']}, commit {meta['commit']}\n\n"
  lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
  lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
  return head + "\n".join(lines) + "\n"


if __name__ == "__main__":
  for arg in sys.argv[1:]:
    print(markdown(arg))
