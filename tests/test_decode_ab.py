"""benchmarks/decode_ab.py on CPU: variants' settings hold exactly while their rows run (and what is traced then
sees them), rounds alternate, settings are restored, a variant that lowers the shipped step is flagged, bad
settings get one error line, and a real tiny decode runs through it."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from benchmarks import decode_ab
from pallas_kernels import dp4a_gemv, policy


@jax.jit
def _traced_gate(x):
  """Reads policy.GATED_EPILOGUE when traced: a cached trace would keep the value of the first call."""
  return x + (1.0 if policy.GATED_EPILOGUE else 0.0)


def _fake_bench(seen, rates):
  """A bench_decode that records the settings it runs under and what a jitted function traced then saw."""

  def bench(config, schemes, batches, prompt_len, new_tokens, runs, on_row=None):
    state = (policy.GATED_EPILOGUE, dp4a_gemv.CODES_TILING)
    traced = float(_traced_gate(jnp.zeros(())))
    seen.append((schemes[0], state, traced))
    rows = []
    for b in batches:
      rows.append({"scheme": schemes[0], "batch": b, "spread": 0.01, "speedup": 1.0,
                   "tokens_per_s": 50.0 if schemes[0] == "bf16" else rates[state],
                   "program_sha1": str(hash(state))})
      if on_row is not None:
        on_row(rows)
    return rows

  return bench


def test_settings_hold_while_their_rows_run_and_are_restored(monkeypatch, tmp_path):
  """Each row runs under its variant's settings (a policy constant, two fields of one tiling dataclass), a jitted
  function traced then sees them (JAX's caches are cleared), the rounds alternate (A B B A), the baseline runs
  first under none, and everything is as before afterwards (two fields of one constant restored in reverse order);
  speedups and the per-variant summary come from the rows."""
  gate, tiling = policy.GATED_EPILOGUE, dp4a_gemv.CODES_TILING
  alt_tiling = dataclasses.replace(tiling, block_n=2 * tiling.block_n, num_warps=2 * tiling.num_warps)
  seen = []
  monkeypatch.setattr(decode_ab, "bench_decode", _fake_bench(seen, {(gate, tiling): 100.0,
                                                                     (not gate, alt_tiling): 120.0}))
  out = tmp_path / "ab.json"
  settings = [f"pallas_kernels.policy.GATED_EPILOGUE={not gate}",
              f"pallas_kernels.dp4a_gemv.CODES_TILING.block_n={alt_tiling.block_n}",
              f"pallas_kernels.dp4a_gemv.CODES_TILING.num_warps={alt_tiling.num_warps}"]
  decode_ab.main(["--variant", "shipped", "--variant", "alt=" + ";".join(settings), "--rounds", "2",
                  "--out", str(out)])
  shipped, alt = ((gate, tiling), 1.0 if gate else 0.0), ((not gate, alt_tiling), 0.0 if gate else 1.0)
  assert [(scheme, state, traced) for scheme, state, traced in seen] == [
      ("bf16", *shipped), ("ternary", *shipped), ("ternary", *alt), ("ternary", *alt), ("ternary", *shipped)]
  assert (policy.GATED_EPILOGUE, dp4a_gemv.CODES_TILING) == (gate, tiling)
  assert float(_traced_gate(jnp.zeros(()))) == shipped[1]
  result = json.loads(out.read_text())
  assert [(r["variant"], r["round"]) for r in result["rows"]] == [("baseline", 0), ("shipped", 1), ("alt", 1),
                                                                    ("alt", 2), ("shipped", 2)]
  assert [r.get("speedup") for r in result["rows"]] == [None, 2.0, 2.4, 2.4, 2.0]
  assert {s["variant"]: (s["tokens_per_s"], s["rounds"]) for s in result["summary"]} == {"shipped": (100.0, 2),
                                                                                       "alt": (120.0, 2)}
  assert not any("same_program_as" in s for s in result["summary"])
  assert result["variants"]["alt"] == settings and "partial" not in result


def test_a_variant_that_lowers_the_shipped_step_is_flagged(monkeypatch, tmp_path, capsys):
  """A setting nothing reads when tracing (here: one the fake's program hash does not see) leaves the variant's
  lowered step the first variant's: the summary says so and a warning line is printed."""
  seen = []
  state = (policy.GATED_EPILOGUE, dp4a_gemv.CODES_TILING)
  monkeypatch.setattr(decode_ab, "bench_decode", _fake_bench(seen, {state: 100.0}))
  out = tmp_path / "ab.json"
  decode_ab.main(["--baseline", "", "--variant", "shipped", "--variant",
                  f"noop=pallas_kernels.dp4a_gemv.DECODE_PROGRAMS_PER_SM={2 * dp4a_gemv.DECODE_PROGRAMS_PER_SM}",
                  "--rounds", "1", "--out", str(out)])
  summary = {s["variant"]: s for s in json.loads(out.read_text())["summary"]}
  assert summary["noop"]["same_program_as"] == "shipped" and "same_program_as" not in summary["shipped"]
  assert summary["noop"]["speedup"] is None  # no baseline: no speedup, not bench_decode's own
  assert "warning: variant noop lowered the same decode step as shipped" in capsys.readouterr().out


def test_settings_are_restored_when_a_row_fails(monkeypatch, tmp_path):
  gate = policy.GATED_EPILOGUE

  def failing(*args, **kwargs):
    assert policy.GATED_EPILOGUE is (not gate)
    raise RuntimeError("out of memory")

  monkeypatch.setattr(decode_ab, "bench_decode", failing)
  with pytest.raises(RuntimeError, match="out of memory"):
    decode_ab.main(["--baseline", "", "--variant", f"off=pallas_kernels.policy.GATED_EPILOGUE={not gate}",
                    "--out", str(tmp_path / "ab.json")])
  assert policy.GATED_EPILOGUE is gate


def test_a_row_whose_model_failed_to_build_is_kept(monkeypatch, tmp_path, capsys):
  """bench_decode's row for a scheme whose model could not be prepared has no batch: the run still writes its
  summary, and the partial file written after each row names the variants."""
  writes = []

  def failed(config, schemes, batches, *args, on_row=None):
    rows = [{"config": config[0], "scheme": schemes[0], "error": "ValueError: cannot build"}]
    on_row(rows)
    writes.append(json.loads((tmp_path / "ab.json").read_text()))
    return rows

  monkeypatch.setattr(decode_ab, "bench_decode", failed)
  decode_ab.main(["--variant", "a", "--rounds", "1", "--out", str(tmp_path / "ab.json")])
  result = json.loads((tmp_path / "ab.json").read_text())
  assert [r["variant"] for r in result["rows"]] == ["baseline", "a"] and result["summary"] == []
  assert writes[0]["partial"] is True and writes[0]["variants"] == {"a": []}
  assert "cannot build" in capsys.readouterr().out


@pytest.mark.parametrize("variant,message", [
    ("x=pallas_kernels.policy.NO_SUCH_POLICY=1", "has no attribute 'NO_SUCH_POLICY'"),
    ("x=pallas_kernels.policy.GATED_EPILOGUE=maybe", "is not a Python literal"),
    ("x=pallas_kernels.policy.GATED_EPILOGUE='yes'", "'yes' is a str, where pallas_kernels.policy.GATED_EPILOGUE"),
    ("x=pallas_kernels.dp4a_gemv.CODES_TILING.block_n=16.0", "is a float, where"),
    ("x=pallas_kernels.dp4a_gemv.CODES_TILING.no_field=1", "not a dataclass instance with a field 'no_field'"),
    ("x=pallas_kernels.dp4a_gemv.Dp4aGemvConfig.block_n=16", "not a dataclass instance with a field 'block_n'"),
    ("x=pallas_kernels.dp4a_gemv.CODES_TILING.split_rule.unsplit_fill=2.0", "nested deeper than ATTRIBUTE.FIELD"),
    ("x=pallas_kernels.policy.GATED_EPILOGUE", "expected module.ATTRIBUTE=VALUE"),
    ("x=.policy.GATED_EPILOGUE=True", "is not a dotted path"),
    ("x=no_such_module.VALUE=1", "no importable module"),
    ("x=pallas_kernels.policy.GATED_EPILOGUE=True;pallas_kernels.policy.GATED_EPILOGUE=False",
     "pallas_kernels.policy.GATED_EPILOGUE set more than once"),
    ("baseline", "names the baseline rows"),
    ("9lives", "must be an identifier"),
])
def test_a_bad_variant_gets_one_error_line(capsys, variant, message):
  with pytest.raises(SystemExit) as exit_:
    decode_ab.main(["--variant", variant])
  assert exit_.value.code == 2
  errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
  assert len(errors) == 1 and message in errors[0], errors


def test_a_module_that_fails_to_import_is_named(tmp_path, monkeypatch, capsys):
  """A module that exists but raises on import is reported as such, not as a shorter path's missing attribute."""
  package = tmp_path / "broken_pkg"
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "mod.py").write_text("import no_such_dependency_here\nVALUE = 1\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  with pytest.raises(SystemExit):
    decode_ab.main(["--variant", "x=broken_pkg.mod.VALUE=2"])
  err = capsys.readouterr().err
  assert "importing broken_pkg.mod failed: ModuleNotFoundError" in err and "no_such_dependency_here" in err


def test_repeated_names_too_few_runs_and_unknown_schemes_are_refused(capsys):
  with pytest.raises(SystemExit):
    decode_ab.main(["--variant", "a", "--variant", "b", "--variant", "a"])
  assert "--variant names repeat: a\n" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    decode_ab.main(["--variant", "a", "--runs", "2"])
  assert "at least 5 runs" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    decode_ab.main(["--variant", "a", "--scheme", "ternry"])
  assert "invalid choice: 'ternry'" in capsys.readouterr().err


NOOP = "pallas_kernels.dp4a_gemv.DECODE_PROGRAMS_PER_SM"  # copied into the dp4a tilings at import: no effect


def test_a_tiny_decode_runs_through_it(tmp_path, capsys):
  """The real decode rows (tiny config, CPU): a bf16 baseline; the shipped code; a setting nothing reads while
  tracing (a constant copied into the tilings at import), whose lowered step is the shipped one's and is flagged;
  and one that flips the gated epilogue, whose step differs. No row fails and the tables are printed."""
  out = tmp_path / "ab.json"
  decode_ab.main(["--config", "tiny", "--scheme", "ternary", "--prompt-len", "4", "--new-tokens", "3", "--rounds", "1",
                  "--variant", "shipped",
                  "--variant", f"noop={NOOP}={dp4a_gemv.DECODE_PROGRAMS_PER_SM + 1}",
                  "--variant", f"gate_flip=pallas_kernels.policy.GATED_EPILOGUE={not policy.GATED_EPILOGUE}",
                  "--out", str(out)])
  result = json.loads(out.read_text())
  rows = result["rows"]
  assert [(r["variant"], r["scheme"]) for r in rows] == [("baseline", "bf16"), ("shipped", "ternary"),
                                                         ("noop", "ternary"), ("gate_flip", "ternary")]
  assert all("error" not in r and r["tokens_per_s"] > 0 and r["runs"] == 5 and r["program_sha1"] for r in rows)
  assert rows[1]["speedup"] == rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
  program = {r["variant"]: r["program_sha1"] for r in rows}
  assert program["noop"] == program["shipped"] != program["gate_flip"]
  flagged = {s["variant"]: s.get("same_program_as") for s in result["summary"]}
  assert flagged == {"shipped": None, "noop": "shipped", "gate_flip": None}
  printed = capsys.readouterr().out
  assert "per variant over its rounds" in printed and "warning: variant noop lowered the same decode step" in printed
