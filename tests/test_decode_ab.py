"""benchmarks/decode_ab.py on CPU: variants' settings hold exactly while their rows run, rounds alternate, bad
settings get one error line, and a real tiny decode runs through it."""

from __future__ import annotations

import json

import pytest

from benchmarks import decode_ab
from pallas_kernels import dp4a_gemv, policy


def test_settings_hold_while_their_rows_run_and_are_restored(monkeypatch, tmp_path):
  """Each row is measured under its variant's settings (a policy constant and a field of a tiling dataclass), the
  rounds alternate (A B B A), the baseline runs first under none, and everything is as before afterwards; speedups
  and the per-variant summary come from the rows."""
  seen = []
  rates = {(True, dp4a_gemv.CODES_TILING.block_n): 100.0, (False, 16): 120.0}

  def fake_bench_decode(config, schemes, batches, prompt_len, new_tokens, runs):
    state = (policy.GATED_EPILOGUE, dp4a_gemv.CODES_TILING.block_n)
    seen.append((schemes[0], state))
    return [{"scheme": schemes[0], "batch": b, "tokens_per_s": 50.0 if schemes[0] == "bf16" else rates[state],
             "spread": 0.01} for b in batches]

  monkeypatch.setattr(decode_ab, "bench_decode", fake_bench_decode)
  before = (policy.GATED_EPILOGUE, dp4a_gemv.CODES_TILING)
  out = tmp_path / "ab.json"
  decode_ab.main(["--variant", "shipped",
                  "--variant", "alt=pallas_kernels.policy.GATED_EPILOGUE=False;"
                               "pallas_kernels.dp4a_gemv.CODES_TILING.block_n=16",
                  "--rounds", "2", "--out", str(out)])
  shipped = (True, before[1].block_n)
  assert seen == [("bf16", shipped), ("ternary", shipped), ("ternary", (False, 16)), ("ternary", (False, 16)),
                  ("ternary", shipped)]
  assert (policy.GATED_EPILOGUE, dp4a_gemv.CODES_TILING) == before
  result = json.loads(out.read_text())
  assert [(r["variant"], r["round"]) for r in result["rows"]] == [("baseline", 0), ("shipped", 1), ("alt", 1),
                                                                    ("alt", 2), ("shipped", 2)]
  assert [r.get("speedup") for r in result["rows"]] == [None, 2.0, 2.4, 2.4, 2.0]
  assert {s["variant"]: (s["tokens_per_s"], s["rounds"]) for s in result["summary"]} == {"shipped": (100.0, 2),
                                                                                       "alt": (120.0, 2)}
  assert result["variants"]["alt"] == ["pallas_kernels.policy.GATED_EPILOGUE=False",
                                       "pallas_kernels.dp4a_gemv.CODES_TILING.block_n=16"]


def test_settings_are_restored_when_a_row_fails(monkeypatch, tmp_path):
  def failing(*args, **kwargs):
    assert policy.GATED_EPILOGUE is False
    raise RuntimeError("out of memory")

  monkeypatch.setattr(decode_ab, "bench_decode", failing)
  with pytest.raises(RuntimeError, match="out of memory"):
    decode_ab.main(["--baseline", "", "--variant", "off=pallas_kernels.policy.GATED_EPILOGUE=False",
                    "--out", str(tmp_path / "ab.json")])
  assert policy.GATED_EPILOGUE is True


@pytest.mark.parametrize("variant,message", [
    ("x=pallas_kernels.policy.NO_SUCH_POLICY=1", "has no attribute 'NO_SUCH_POLICY'"),
    ("x=pallas_kernels.policy.GATED_EPILOGUE=maybe", "is not a Python literal"),
    ("x=pallas_kernels.dp4a_gemv.CODES_TILING.no_field=1", "not a dataclass with a field 'no_field'"),
    ("x=pallas_kernels.policy.GATED_EPILOGUE", "expected module.ATTRIBUTE=VALUE"),
    ("x=no_such_module.VALUE=1", "no importable module"),
    ("9lives", "must be an identifier"),
])
def test_a_bad_variant_gets_one_error_line(capsys, variant, message):
  with pytest.raises(SystemExit) as exit_:
    decode_ab.main(["--variant", variant])
  assert exit_.value.code == 2
  errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
  assert len(errors) == 1 and message in errors[0], errors


def test_repeated_names_and_too_few_runs_are_refused(capsys):
  with pytest.raises(SystemExit):
    decode_ab.main(["--variant", "a", "--variant", "a"])
  assert "names repeat" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    decode_ab.main(["--variant", "a", "--runs", "2"])
  assert "at least 5 runs" in capsys.readouterr().err


def test_a_tiny_decode_runs_through_it(tmp_path, capsys):
  """The real decode rows (tiny config, CPU): a baseline and one variant whose setting turns the gated epilogue
  off; no row fails and the table is printed."""
  out = tmp_path / "ab.json"
  decode_ab.main(["--config", "tiny", "--scheme", "ternary", "--prompt-len", "4", "--new-tokens", "3", "--rounds", "1",
                  "--variant", "gate_off=pallas_kernels.policy.GATED_EPILOGUE=False", "--out", str(out)])
  rows = json.loads(out.read_text())["rows"]
  assert [(r["variant"], r["scheme"]) for r in rows] == [("baseline", "bf16"), ("gate_off", "ternary")]
  assert all("error" not in r and r["tokens_per_s"] > 0 and r["runs"] == 5 for r in rows)
  assert rows[1]["speedup"] == rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
  assert "per variant over its rounds" in capsys.readouterr().out
