"""Every README code block runs as written, without a warning, and prints what it says.

Python blocks run one by one in a fresh interpreter each (the README never relies on an
earlier block). Bash blocks are commands for a fresh machine (``pip install`` ...): the test
checks what they name exists (extras, modules, configs); the tiny training command itself runs
in ``test_train_loop``.
"""

import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

from helpers import xla_flags_with_devices

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```", README, flags=re.DOTALL | re.MULTILINE)
PYTHON = [code for lang, code in BLOCKS if lang == "python"]
BASH = [code for lang, code in BLOCKS if lang == "bash"]


# What a block prints, found by a piece of its code: each regex must match a line of its stdout.
PRINTS = {
    "jaxlowbit.convert(": [  # the Use block: the filter keeps the head, the rest runs int8
        r"^layers_0\s+2048\s+4096\s+Int8MixedPrecision\(",
        r"^layers_2\s+4096\s+2048\s+filtered",
        r"^1 of 2 Dense layers converted$",
    ],
    "optim.make(": [r"^2\.03 state bytes per parameter$"],  # the optimizer block: the table's 2.03 B
}


def _block(marker: str) -> int:
  found = [i for i, code in enumerate(PYTHON) if marker in code]
  assert len(found) == 1, f"{len(found)} README python blocks contain {marker!r}; expected one"
  return found[0]


def test_readme_has_the_blocks_we_expect():
  assert len(PYTHON) >= 4 and len(BASH) >= 2
  assert {lang for lang, _ in BLOCKS} <= {"python", "bash"}  # a new language needs a check here
  for marker in PRINTS:
    _block(marker)


@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_python_block_runs(index):
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = xla_flags_with_devices(4)
  result = subprocess.run(
      [sys.executable, "-c", PYTHON[index]], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
  )
  assert result.returncode == 0, f"README python block {index} failed:\n{PYTHON[index]}\n{result.stderr[-3000:]}"
  warned = [line for line in result.stderr.splitlines() if "Warning:" in line]
  assert not warned, f"README python block {index} warns:\n" + "\n".join(warned)
  for marker, patterns in PRINTS.items():
    if marker in PYTHON[index]:
      for pattern in patterns:
        assert re.search(pattern, result.stdout, flags=re.MULTILINE), (
            f"README python block {index} should print a line matching {pattern!r}; it printed:\n{result.stdout}")


def test_bash_blocks_name_what_exists():
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  commands = [line for block in BASH for line in block.splitlines() if line.strip()]
  for command in commands:
    for group in re.findall(r'"\.\[([\w,]+)\]"', command):
      for extra in group.split(","):
        assert extra in extras, f"{command!r}: no extra {extra!r} in pyproject.toml"
    for module in re.findall(r"python -m ([\w.]+)", command):
      if module == "pytest":
        continue
      assert (ROOT / (module.replace(".", "/") + ".py")).exists(), f"{command!r}: no module {module}"
    for config in re.findall(r"--config (\S+)", command):
      assert (ROOT / config).exists(), f"{command!r}: no config {config}"
  assert any("configs/tiny.py" in c for c in commands) and any("pytest" in c for c in commands)
