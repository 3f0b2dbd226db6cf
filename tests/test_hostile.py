"""benchmarks/hostile.py (the issue-31 battery): its classification, and a few of its cheap cases run for real.

The whole battery (about 80 cases, minutes) is not run here; ``python benchmarks/hostile.py`` is.
"""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/ is not an installed package
from benchmarks import hostile  # noqa: E402
from benchmarks.hostile import Outcome, Proc  # noqa: E402


def _proc(rc, err="", out=""):
  return Proc(["x"], rc, out, err)


def _wrong(proc):
  return "wrong"


@pytest.mark.parametrize("proc, must, want", [
    (_proc(2, "error: config.lr must be a finite number, got nan\n"), ["config.lr"], "clear"),
    (_proc(2, "note: something first\nerror: t.bin: holds token id 9\n"), ["t.bin"], "clear"),
    (_proc(2, "error: config.lr must be finite\n"), ["config.eps"], "unclear"),  # names another field
    (_proc(1, "error: KeyError: 'x'\n"), [], "unclear"),  # a bug's exit code
    (_proc(3, "error: loss is NaN at step 3; lower config.lr\n"), ["config.lr"], "unclear"),  # after training began
    (_proc(2, "Traceback (most recent call last):\n  ...\nerror: bad\n"), [], "unclear"),
    (_proc(2, "error: one\nerror: two\n"), [], "unclear"),
    (_proc(2, "error: CorruptCheckpointError: no checkpoint is verified\n"), [], "unclear"),  # a bug's form
    (_proc(2, "warning: x\n" * hostile.MAX_STDERR_LINES + "error: bad\n"), [], "unclear"),  # a wall of stderr
    (_proc(0, "", "done"), [], "silent"),  # exit 0 where the check says the result is wrong
])
def test_outcomes_are_classified_as_the_battery_defines_them(proc, must, want):
  assert hostile.outcome(proc, _wrong, must).kind == want


def test_exit_0_with_a_passing_check_is_handled_and_documented_codes_count_as_clear():
  assert hostile.outcome(_proc(0, "warning: skipped 12\n"), lambda p: None).kind == "handled"
  assert hostile.outcome(_proc(4, "error: no checkpoint is verified\n"), _wrong, ["verified"], codes=(4,)).kind == "clear"
  assert hostile.outcome(_proc(2, "error: no checkpoint is verified\n"), _wrong, codes=(4,)).kind == "unclear"


def test_library_calls_are_classified_by_their_exception_or_result():
  def raises(message):
    raise ValueError(message)
  assert hostile.library(lambda: raises("pack_2bit: got 2"), _wrong, ["2"]).kind == "clear"
  assert hostile.library(lambda: raises("line one\nline two"), _wrong).kind == "unclear"
  assert hostile.library(lambda: raises("something"), _wrong, ["seed"]).kind == "unclear"
  assert hostile.library(lambda: 1, _wrong).kind == "silent"
  assert hostile.library(lambda: 1, lambda r: None).kind == "handled"


# One case of each runner: the real command line (a config value it refuses before any work), two library calls
# (issue 31's silent ones), a document check. Under 30 s on a loaded 2-core machine.
CHEAP = ("config lr=nan", "optax.adamw.update(adamw_8bit state)", "pack_2bit([2, -2, 3, 1])", "docs: recipe lists")


def test_a_few_cheap_cases_of_the_battery_are_clear_or_handled(tmp_path):
  cases = [case for case in hostile.CASES if case.name in CHEAP]
  assert len(cases) == len(CHEAP) and all(case.cheap for case in cases)
  results = {case.name: result for case, result, _ in hostile.run_cases(cases, tmp_path, verbose=False)}
  assert results["config lr=nan"] == Outcome("clear", results["config lr=nan"].detail)
  assert "config.lr" in results["config lr=nan"].detail
  assert results["optax.adamw.update(adamw_8bit state)"].kind == "clear"
  assert results["pack_2bit([2, -2, 3, 1])"].kind == "clear"
  assert results["docs: recipe lists"].kind == "handled"
  assert "silent 0" in hostile.table([(c, results[c.name], 0.0) for c in cases])
