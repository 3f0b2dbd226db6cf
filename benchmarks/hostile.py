"""The issue-31 battery: bad inputs and faults as a hostile user tries them, each classified.

Every case runs the real command line (``python -m train.main``, ``train.hf``, ``train.generate``,
``train.data``, ``train.plot``) as a subprocess on CPU with a micro version of ``configs/tiny.py``,
or calls the library in this process, and sorts the outcome into one of

==========  ====================================================================================
handled     it worked, and the case's own check of the result passed (the checkpoint was moved
            aside and the redone steps logged the uninterrupted run's losses, the warning came, ...)
clear       exit 2 (or the documented code the case names) with exactly one ``error:`` line on
            stderr that names what the case says it must (the field, the file), no traceback and
            at most :data:`MAX_STDERR_LINES` lines of stderr; in the library: an exception of one
            line naming the same
unclear     any other failure: another exit code, no or several ``error:`` lines, a traceback, a
            message that does not name the cause, a wall of stderr
silent      exit 0 (or no exception) with a wrong result or lost work; each case's ``check`` says
            how the result is checked
skipped     the case cannot be staged here (e.g. a read-only folder when running as root)
==========  ====================================================================================

and prints a table and the counts. One trained micro run (12 steps, checkpoints 4, 8, 12) is reused
by every checkpoint, export and generate case (each works on its own copy); a longer one is trained
for the signal cases. About 4-8 minutes on 2 shared CPU cores.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/hostile.py [--only SUBSTRING ...] [--out result.json]

``tests/test_hostile.py`` runs the classification on a few cheap cases; the whole battery is not run by CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

KINDS = ("handled", "clear", "unclear", "silent", "skipped")
# A clear error is one line, perhaps after a few notes; a wall of warnings around it is not (issue 31: 270-370 lines).
MAX_STDERR_LINES = 12
CASE_TIMEOUT_S = 300
# train/cli.py prints an exception's type only for a bug: "error: KeyError: 'x'"; a user mistake is its message alone.
BUG_LINE = re.compile(r"error: [A-Za-z_.]*(Error|Exception|Interrupt)\b")
# The micro run every checkpoint case copies: 12 steps, checkpoints 4, 8 and 12, every loss logged.
MICRO = ("--config=configs/tiny.py", "--config.data.val_fraction=0.2", "--config.steps=12",
         "--config.batch_size=4", "--config.seq_len=32", "--config.warmup_steps=2", "--config.log_every=1",
         "--config.eval_every=6", "--config.eval_batches=1", "--config.checkpoint_every=4",
         "--config.keep_checkpoints=5", "--config.tensorboard=False", "--config.mesh.fsdp=1")
# The run the signal cases interrupt: long enough that a signal lands mid-run on a loaded machine.
LONG_STEPS = 400
LONG = (*MICRO, f"--config.steps={LONG_STEPS}", "--config.checkpoint_every=20", "--config.keep_checkpoints=3",
        "--config.eval_every=1000")
CORPUS_FILES = 16  # train/*.py and friends: some files go to validation at val_fraction 0.2
PROMPT = "def "


@dataclasses.dataclass
class Proc:
  """A finished command: its arguments, exit code and output."""
  args: list[str]
  rc: int
  out: str
  err: str

  @property
  def error_lines(self) -> list[str]:
    return [line for line in self.err.splitlines() if line.startswith("error:")]


@dataclasses.dataclass
class Outcome:
  kind: str
  detail: str


@dataclasses.dataclass
class Case:
  name: str
  source: str  # the group: silent | unclear | friction | drill
  what: str  # what is tried
  run: Callable[["Context"], Outcome]
  cheap: bool = False  # needs no trained run (tests/test_hostile.py picks from these)


def _env(extra: dict | None = None) -> dict:
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  env.pop("XLA_FLAGS", None)  # one CPU device: the unsharded loop
  env.update(extra or {})
  return env


def command(module: str, *args: str, cwd: pathlib.Path = REPO, timeout: float = CASE_TIMEOUT_S,
            prefix: Sequence[str] = ()) -> Proc:
  """Run ``python -m module args`` (``prefix``: e.g. a shell with ulimit) and return what it did."""
  argv = [*prefix, sys.executable, "-m", module, *map(str, args)]
  try:
    done = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired as e:
    return Proc(argv, -1, str(e.stdout or ""), f"timed out after {timeout} s\n{e.stderr or ''}")
  return Proc(argv, done.returncode, done.stdout, done.stderr)


def classify_error(proc: Proc, must: Sequence[str] = (), codes: Sequence[int] = (2,)) -> Outcome:
  """``clear`` when ``proc`` failed with one of ``codes``, exactly one ``error:`` line naming every string of
  ``must``, no traceback and a short stderr; ``unclear`` otherwise."""
  problems = []
  if proc.rc not in codes:
    problems.append(f"exit {proc.rc} (want {'/'.join(map(str, codes))})")
  if len(proc.error_lines) != 1:
    problems.append(f"{len(proc.error_lines)} error: lines")
  if "Traceback" in proc.err:
    problems.append("a traceback")
  if len(proc.err.splitlines()) > MAX_STDERR_LINES:
    problems.append(f"{len(proc.err.splitlines())} lines of stderr")
  line = proc.error_lines[0] if proc.error_lines else ""
  if BUG_LINE.match(line):
    problems.append("a Python type name (the form of a bug, train/cli.py)")
  missing = [name for name in must if name not in line]
  if missing:
    problems.append(f"does not name {missing}")
  shown = line or (proc.err.strip().splitlines() or ["(no stderr)"])[-1]
  shown = shown if len(shown) <= 160 else shown[:157] + "..."
  if problems:
    return Outcome("unclear", "; ".join(problems) + f": {shown}")
  return Outcome("clear", shown)


def outcome(proc: Proc, check: Callable[[Proc], str | None], must: Sequence[str] = (),
            codes: Sequence[int] = (2,)) -> Outcome:
  """Exit 0: ``handled`` when ``check(proc)`` is None, else ``silent`` with its reason; a failure:
  :func:`classify_error`."""
  if proc.rc != 0:
    return classify_error(proc, must, codes)
  wrong = check(proc)
  return Outcome("silent", wrong) if wrong else Outcome("handled", _last_line(proc))


def _last_line(proc: Proc) -> str:
  """What a successful command said that matters most: its first warning or note, else how it ended."""
  lines = [line for line in (proc.err + proc.out).splitlines() if line.strip()]
  ends = [line for line in lines if line.startswith(("summary:", "this run already finished", "wrote "))]
  text = next((line for line in lines if line.startswith(("warning:", "note:", "error:"))),
              ends[0] if ends else (lines[-1] if lines else ""))
  return text if len(text) <= 160 else text[:157] + "..."


def must_fail(why: str) -> Callable[[Proc], str]:
  """The check of a case where exit 0 is wrong whatever it printed."""
  return lambda proc: f"exit 0: {why}"


def library(call: Callable[[], object], check: Callable[[object], str | None], must: Sequence[str] = ()) -> Outcome:
  """A library call: an exception of one line naming ``must`` is clear (a longer one or one that does not name
  them unclear); a return is ``handled`` when ``check(result)`` is None, else ``silent``."""
  try:
    result = call()
  except Exception as e:  # noqa: BLE001  (classified)
    text = str(e).strip()
    name = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
    shown = name if len(name) <= 160 else name[:157] + "..."
    missing = [m for m in must if m not in text]
    if "\n" in text or missing or not text:
      return Outcome("unclear", (f"does not name {missing}: " if missing else "several lines: ") + shown)
    return Outcome("clear", shown)
  wrong = check(result)
  return Outcome("silent", wrong) if wrong else Outcome("handled", "as it should")


class Context:
  """The shared material: a small corpus, the trained micro run, references made from it (built on first use)."""

  def __init__(self, root: pathlib.Path):
    self.root = root
    self._made: dict[str, object] = {}
    self._copies = 0

  def once(self, name: str, make: Callable[[], object]):
    if name not in self._made:
      self._made[name] = make()
    return self._made[name]

  @property
  def corpus(self) -> pathlib.Path:
    def make():
      folder = self.root / "corpus"
      folder.mkdir()
      for path in sorted((REPO / "train").glob("*.py"))[:CORPUS_FILES]:
        shutil.copy(path, folder / path.name)
      return folder
    return self.once("corpus", make)

  def micro(self, *extra: str) -> list[str]:
    return [*MICRO, f"--config.data.path={self.corpus}", *extra]

  def long(self, *extra: str) -> list[str]:
    return [*LONG, f"--config.data.path={self.corpus}", *extra]

  def _trained(self, name: str, args: list[str]) -> pathlib.Path:
    def make():
      run = self.root / name
      proc = command("train.main", *args, f"--workdir={run}")
      if proc.rc != 0:
        raise RuntimeError(f"the reference run {name} failed (exit {proc.rc}): {proc.err[-2000:]}")
      self._made[name + "_proc"] = proc
      return run
    return self.once(name, make)

  @property
  def run(self) -> pathlib.Path:
    """The finished micro run: checkpoints 4, 8, 12; every step's loss logged."""
    return self._trained("micro_run", self.micro())

  @property
  def run_proc(self) -> Proc:
    self.run  # noqa: B018  (trains it)
    return self._made["micro_run_proc"]

  @property
  def long_run(self) -> pathlib.Path:
    return self._trained("long_run", self.long())

  def copy(self, run: pathlib.Path | None = None) -> pathlib.Path:
    self._copies += 1
    target = self.root / f"copy{self._copies}"
    shutil.copytree(run or self.run, target)
    return target

  @property
  def hf_folder(self) -> pathlib.Path:
    """A Hugging Face export of the micro run (what the init_from cases damage)."""
    def make():
      out = self.root / "hf"
      proc = command("train.hf", "export", "--checkpoint", self.run, "--out", out, "--dtype", "float32")
      if proc.rc != 0:
        raise RuntimeError(f"the reference export failed: {proc.err[-2000:]}")
      return out
    return self.once("hf", make)

  def hf_copy(self) -> pathlib.Path:
    self._copies += 1
    target = self.root / f"hf{self._copies}"
    shutil.copytree(self.hf_folder, target)
    return target

  @property
  def step8_text(self) -> str:
    """What train.generate writes from checkpoint 8 of the intact run (greedy)."""
    def make():
      proc = command("train.generate", "--checkpoint", self.run, "--step", 8, *GENERATE)
      if proc.rc != 0:
        raise RuntimeError(f"the reference generate failed: {proc.err[-2000:]}")
      return generated_text(proc)
    return self.once("step8_text", make)


GENERATE = ("--prompt", PROMPT, "--max_new_tokens", 24, "--scheme", "bf16")


def generated_text(proc: Proc) -> str:
  return proc.out.split("\n[")[0]


def losses(run: pathlib.Path) -> dict[int, float]:
  """The last logged training loss of every step of ``run``'s metrics.jsonl (a resumed run logs steps again)."""
  found = {}
  path = run / "metrics.jsonl"
  for line in path.read_text().splitlines() if path.exists() else []:
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    if "loss" in record:
      found[record["step"]] = record["loss"]
  return found


def same_losses(run: pathlib.Path, reference: pathlib.Path, steps: Sequence[int] | None = None) -> str | None:
  """None when ``run`` logged the reference run's loss at every step (bit for bit), else the first difference."""
  got, want = losses(run), losses(reference)
  for step in steps or sorted(want):
    if got.get(step) != want[step]:
      return f"step {step}: loss {got.get(step)} where the uninterrupted run logged {want[step]}"
  return None


def _checkpoints():
  from train import checkpoint  # noqa: PLC0415  (jax: only when a case needs it)
  return checkpoint


# ----------------------------------------------------------------------------------------------------------------
# Damaged checkpoints: the newest one (12) on the save grid; the resume must skip it, move it aside and redo 9-12.


def _largest(step_dir: pathlib.Path) -> pathlib.Path:
  files = [p for p in step_dir.rglob("*") if p.is_file() and p.name != "jaxlowbit_manifest.json"]
  return max(files, key=lambda p: p.stat().st_size)


def _flip(path: pathlib.Path) -> None:
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x10
  path.write_bytes(bytes(data))


def _truncate(path: pathlib.Path) -> None:
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _edit_position(step_dir: pathlib.Path) -> None:
  path = next(p for p in (step_dir / "data").rglob("*") if p.is_file() and '"position"' in p.read_text())
  state = json.loads(path.read_text())
  state["position"] = 1
  path.write_text(json.dumps(state))


def _manifest(text: str):
  return lambda d: (d / "jaxlowbit_manifest.json").write_text(text)


DAMAGE = {
    "bit flip": lambda d: _flip(_largest(d)),
    "truncated file": lambda d: _truncate(_largest(d)),
    "deleted file": lambda d: os.remove(_largest(d)),
    "garbage manifest": _manifest("{not json"),
    "manifest []": _manifest("[]"),
    'manifest {"step": 12, "files": {}}': _manifest(json.dumps({"step": 12, "files": {}})),
    "no manifest (SIGKILL before it)": lambda d: os.remove(d / "jaxlowbit_manifest.json"),
    "_CHECKPOINT_METADATA deleted": lambda d: os.remove(d / "_CHECKPOINT_METADATA"),
    "state/ deleted": lambda d: shutil.rmtree(d / "state"),
    "data JSON edited (position 1)": _edit_position,
}


def damaged_resume(damage: Callable[[pathlib.Path], None]) -> Callable[[Context], Outcome]:
  def run(ctx: Context) -> Outcome:
    work = ctx.copy()
    damage(work / "checkpoints" / "12")
    proc = command("train.main", *ctx.micro(), f"--workdir={work}", "--resume")

    def check(proc: Proc) -> str | None:
      aside = [p.name for p in (work / "checkpoints").iterdir() if not p.name.isdigit()]
      if not aside:
        return "nothing was moved aside (the next --resume meets the same step)"
      if not (work / "checkpoints" / "12").is_dir() or _checkpoints().verify(work / "checkpoints" / "12"):
        return "no verified checkpoint 12 after the redone steps"
      if "resumed from" not in proc.out + proc.err or "8" not in proc.out + proc.err:
        return "the output does not say it resumed from 8"
      return same_losses(work, ctx.run, [9, 10, 11, 12])
    return outcome(proc, check)
  return run


def every_checkpoint_damaged(ctx: Context) -> Outcome:
  work = ctx.copy()
  for step in (4, 8, 12):
    _flip(_largest(work / "checkpoints" / str(step)))
  proc = command("train.main", *ctx.micro(), f"--workdir={work}", "--resume")
  return outcome(proc, must_fail("trained from a damaged state"), must=["verified"], codes=(4,))


def resume_twice_after_damage(ctx: Context) -> Outcome:
  """The issue's loop: every --resume failed at the redone step. Damage 12, resume, resume again."""
  work = ctx.copy()
  _flip(_largest(work / "checkpoints" / "12"))
  first = command("train.main", *ctx.micro(), f"--workdir={work}", "--resume")
  if first.rc != 0:
    return classify_error(first)
  second = command("train.main", *ctx.micro(), f"--workdir={work}", "--resume")
  return outcome(second, lambda p: None if "already finished" in p.out + p.err else
                 "the second --resume did not say the run finished")


def reader_of_corrupt_newest(tool: str) -> Callable[[Context], Outcome]:
  """train.generate reads checkpoint 8 (with a warning); train.hf export refuses, naming step 8."""
  def run(ctx: Context) -> Outcome:
    work = ctx.copy()
    _flip(_largest(work / "checkpoints" / "12"))
    if tool == "generate":
      want = ctx.step8_text
      proc = command("train.generate", "--checkpoint", work, *GENERATE)

      def check(proc: Proc) -> str | None:
        if "corrupt" not in proc.err:
          return "no word of the corrupt checkpoint 12"
        if "step 8" not in proc.out:
          return "did not read step 8"
        return None if generated_text(proc) == want else "the text differs from checkpoint 8's"
      return outcome(proc, check)
    proc = command("train.hf", "export", "--checkpoint", work, "--out", ctx.root / f"export{ctx._copies}")
    return outcome(proc, must_fail("exported without refusing the corrupt newest checkpoint"), must=["12", "--step 8"])
  return run


def reader_step(tool: str, step: int, damage: bool, must: Sequence[str]) -> Callable[[Context], Outcome]:
  def run(ctx: Context) -> Outcome:
    work = ctx.copy()
    if damage:
      _flip(_largest(work / "checkpoints" / "12"))
    if tool == "generate":
      proc = command("train.generate", "--checkpoint", work, "--step", step, *GENERATE)
    else:
      proc = command("train.hf", "export", "--checkpoint", work, "--step", step, "--out", work / "export")
    return outcome(proc, must_fail(f"read step {step}"), must=must)
  return run


def reader_missing_run(tool: str) -> Callable[[Context], Outcome]:
  def run(ctx: Context) -> Outcome:
    missing = ctx.root / "no-such-run"
    if tool == "generate":
      proc = command("train.generate", "--checkpoint", missing, *GENERATE)
    else:
      proc = command("train.hf", "export", "--checkpoint", missing, "--out", ctx.root / "nowhere")
    return outcome(proc, must_fail("read a run that does not exist"), must=["no-such-run"])
  return run


# ----------------------------------------------------------------------------------------------------------------
# Export


def export_int8_dtype(ctx: Context) -> Outcome:
  out = ctx.root / "export-int8"
  proc = command("train.hf", "export", "--checkpoint", ctx.run, "--out", out, "--dtype", "int8")

  def check(proc: Proc) -> str | None:
    from safetensors.numpy import load_file  # noqa: PLC0415
    tensors = {}
    for path in out.glob("*.safetensors"):
      tensors.update(load_file(path))
    zero = [name for name, value in tensors.items() if value.ndim == 2 and not value.any()]
    return f"exit 0 with {len(zero)} all-zero matrices" if zero else "exit 0 with int8 storage (no scales)"
  return outcome(proc, check, must=["--dtype int8", "--scheme"])


def export_out_under_a_file(ctx: Context) -> Outcome:
  blocker = ctx.root / "a-file"
  blocker.write_text("x")
  proc = command("train.hf", "export", "--checkpoint", ctx.run, "--out", blocker / "out")
  return outcome(proc, must_fail("wrote under a file"), must=["a-file"])


def export_out_read_only(ctx: Context) -> Outcome:
  """--out inside a folder nobody may write to: mode 555, or for root (who writes anyway) the immutable flag."""
  folder = ctx.root / "read-only"
  folder.mkdir()
  folder.chmod(0o555)
  as_root = os.geteuid() == 0
  if as_root and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
    folder.chmod(0o755)
    return Outcome("skipped", "running as root without chattr +i: a read-only folder is writable")
  try:
    proc = command("train.hf", "export", "--checkpoint", ctx.run, "--out", folder / "out")
  finally:
    if as_root:
      subprocess.run(["chattr", "-i", str(folder)], check=True)
    folder.chmod(0o755)
  return outcome(proc, must_fail("wrote into a read-only folder"), must=["read-only/out"])


def export_disk_full(fmt: str) -> Callable[[Context], Outcome]:
  """A file-size limit (ulimit -f: writes past it fail with EFBIG, as on a full disk) during the export."""
  def run(ctx: Context) -> Outcome:
    out = ctx.root / f"export-full-{fmt}"
    limit_kib = 64  # the micro model's weights are ~0.5 MiB in float32
    proc = command("train.hf", "export", "--checkpoint", ctx.run, "--out", out, "--format", fmt, "--dtype",
                   "float32", prefix=("bash", "-c", f'ulimit -f {limit_kib}; exec "$@"', "--"))

    def check(proc: Proc) -> str | None:
      return "exit 0 although no file over the limit could be written"
    result = outcome(proc, check, must=[str(out.name)])
    partial = [p.name for p in out.rglob("*") if p.is_file()] if out.exists() else []
    if partial and result.kind != "silent":
      return Outcome("unclear" if result.kind == "clear" else result.kind,
                     f"left partial file(s) {partial[:3]}; {result.detail}")
    return result
  return run


# ----------------------------------------------------------------------------------------------------------------
# Resume


def resume_bad_config_json(text: str) -> Callable[[Context], Outcome]:
  def run(ctx: Context) -> Outcome:
    work = ctx.copy()
    (work / "config.json").write_text(text)
    proc = command("train.main", *ctx.micro(), f"--workdir={work}", "--resume")
    return outcome(proc, must_fail("resumed with an unreadable config.json"), must=["config.json"])
  return run


def resume_cut_metrics(ctx: Context) -> Outcome:
  """A half-written last line of metrics.jsonl (disk full) and checkpoint 12 gone: the resume redoes 9-12."""
  work = ctx.copy()
  shutil.rmtree(work / "checkpoints" / "12")
  path = work / "metrics.jsonl"
  path.write_text(path.read_text() + '{"step": 13, "loss": 4.')
  proc = command("train.main", *ctx.micro(), f"--workdir={work}", "--resume")
  return outcome(proc, lambda p: same_losses(work, ctx.run, [9, 10, 11, 12]))


def resume_bad_metrics_line(ctx: Context) -> Outcome:
  work = ctx.copy()
  shutil.rmtree(work / "checkpoints" / "12")
  path = work / "metrics.jsonl"
  lines = path.read_text().splitlines()
  lines[2] = lines[2][:10]
  path.write_text("\n".join(lines) + "\n")
  proc = command("train.main", *ctx.micro(), f"--workdir={work}", "--resume")
  return outcome(proc, lambda p: "a damaged metrics line in the middle was accepted without a word"
                 if "metrics.jsonl" not in p.err else None, must=["metrics.jsonl", "line 3"])


def resume_other_config(ctx: Context) -> Outcome:
  """config.json deleted and model.d_model changed: the checkpoints are another config's."""
  work = ctx.copy()
  os.remove(work / "config.json")
  proc = command("train.main", *ctx.micro("--config.model.d_model=96"), f"--workdir={work}", "--resume")
  return outcome(proc, must_fail("resumed another config's checkpoints"), must=["another config"])


def resume_shape_change(ctx: Context) -> Outcome:
  work = ctx.copy()
  proc = command("train.main", *ctx.micro("--config.model.d_model=96"), f"--workdir={work}", "--resume")
  return outcome(proc, must_fail("resumed with other shapes"), must=["model.d_model"])


def resume_finished(ctx: Context) -> Outcome:
  work = ctx.copy()
  proc = command("train.main", *ctx.micro(), f"--workdir={work}", "--resume")
  return outcome(proc, lambda p: None if "already finished" in p.out + p.err else "did not say the run finished")


def workdir_with_checkpoints_no_resume(ctx: Context) -> Outcome:
  work = ctx.copy()
  proc = command("train.main", *ctx.micro(), f"--workdir={work}")
  return outcome(proc, lambda p: "trained over an existing run without --resume", must=["--resume"])


# ----------------------------------------------------------------------------------------------------------------
# Signals (the long run)


def _start(ctx: Context, work: pathlib.Path, *extra: str) -> subprocess.Popen:
  argv = [sys.executable, "-m", "train.main", *ctx.long(), f"--workdir={work}", *extra]
  return subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(work: pathlib.Path, process: subprocess.Popen, step: int, timeout: float = 240.0) -> bool:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline and process.poll() is None:
    if any(s >= step for s in losses(work)):
      return True
    time.sleep(0.005)
  return False


def _too_early(process: subprocess.Popen, what: str) -> Outcome:
  """The run ended (or stalled) before the ``what`` could land: a failed run is classified, a finished one skipped."""
  if process.poll() is None:
    process.kill()
  out, err = process.communicate()
  if process.returncode not in (0, -signal.SIGKILL):
    return classify_error(Proc(process.args, process.returncode, out, err), codes=())
  return Outcome("skipped", f"the run ended before the {what} could land")


def interrupted(signals: Sequence[int], gap_s: float, code: int) -> Callable[[Context], Outcome]:
  """Signal the long run mid-way (``signals`` ``gap_s`` apart), expect exit ``code``, resume it, and compare every
  logged loss with the uninterrupted run's."""
  def run(ctx: Context) -> Outcome:
    reference = ctx.long_run
    work = ctx.root / f"signal{len(signals)}-{signals[0]}"
    process = _start(ctx, work)
    if not _wait_for_step(work, process, LONG_STEPS // 8):
      return _too_early(process, "signal")
    for i, signum in enumerate(signals):
      if i:
        time.sleep(gap_s)
      process.send_signal(signum)
    out, err = process.communicate(timeout=CASE_TIMEOUT_S)
    stopped = Proc(process.args, process.returncode, out, err)
    if stopped.rc == 0:
      return Outcome("skipped", "the run finished before the signal landed")
    if stopped.rc != code:
      return classify_error(stopped, codes=(code,))
    resumed = command("train.main", *ctx.long(), f"--workdir={work}", "--resume")
    return outcome(resumed, lambda p: same_losses(work, reference))
  return run


def sigkill_then_resume(ctx: Context) -> Outcome:
  """SIGKILL mid-run: every committed checkpoint must verify, and the resume logs the uninterrupted run's losses."""
  reference = ctx.long_run
  work = ctx.root / "sigkill"
  process = _start(ctx, work)
  if not _wait_for_step(work, process, LONG_STEPS // 4):
    return _too_early(process, "kill")
  process.kill()
  process.communicate()
  checkpoint = _checkpoints()
  steps = checkpoint.saved_steps(work)
  bad = [(s, checkpoint.verify(work / "checkpoints" / str(s))) for s in steps]
  bad = [(s, r) for s, r in bad if r]
  resumed = command("train.main", *ctx.long(), f"--workdir={work}", "--resume")

  def check(proc: Proc) -> str | None:
    start = re.search(r"resumed from \S+/(\d+) ", proc.out + proc.err)
    if not start:
      return "the resume does not say which checkpoint it continued from"
    start = int(start.group(1))
    if any(step == start for step, _ in bad):
      return f"resumed from checkpoint {start}, which fails verification ({dict(bad)[start]})"
    newer = [(step, why) for step, why in bad if step > start]
    if newer and "unverified" not in proc.out + proc.err and "corrupt" not in proc.out + proc.err:
      return f"newer checkpoint(s) {newer} were passed over without a word"
    return same_losses(work, reference)
  result = outcome(resumed, check)
  older = [step for step, _ in bad]  # what the check left: older than the one resumed from
  if result.kind == "handled" and older:
    # orbax removes checkpoints beyond keep_checkpoints after each save; a kill during that removal leaves an older
    # step half-deleted: never read (the resume takes the newest verified one), removed by the next save's cleanup
    result = Outcome("handled", f"{result.detail}; older checkpoint(s) {older} half-deleted by the kill, not read")
  return result


# ----------------------------------------------------------------------------------------------------------------
# Config values (train.main, before any work)


def config_value(override: str, must: Sequence[str]) -> Callable[[Context], Outcome]:
  def run(ctx: Context) -> Outcome:
    work = ctx.root / f"cfg{abs(hash(override))}"
    proc = command("train.main", "--config=configs/tiny.py", override, "--config.steps=2", "--config.warmup_steps=1", f"--workdir={work}")
    result = outcome(proc, must_fail(f"trained with {override}"), must=must)
    if result.kind == "clear" and (proc.out.strip() or work.exists()):
      return Outcome("unclear", f"printed or wrote before the error: {proc.out.strip()[:80]!r}; {result.detail}")
    return result
  return run


def misspelled_override(ctx: Context) -> Outcome:
  proc = command("train.main", "--config=configs/tiny.py", "--config.model.d_modl=3", f"--workdir={ctx.root / 'x'}")
  result = outcome(proc, must_fail("ran with an unknown field"), must=["d_modl", "d_model"])
  if result.kind == "clear" and ("\\" in proc.error_lines[0]):
    return Outcome("unclear", f"escaped quotes or a literal \\n: {proc.error_lines[0][:120]}")
  return result


def missing_config_file(ctx: Context) -> Outcome:
  proc = command("train.main", "--config=configs/no_such.py", f"--workdir={ctx.root / 'x'}")
  return outcome(proc, must_fail("ran without a config"), must=["no_such.py"])


def config_syntax_error(ctx: Context) -> Outcome:
  path = ctx.root / "broken.py"
  path.write_text("def get_config(:\n")
  proc = command("train.main", f"--config={path}", f"--workdir={ctx.root / 'x'}")
  return outcome(proc, must_fail("ran a config that does not parse"), must=["broken.py"])


def workdir_is_a_file(ctx: Context) -> Outcome:
  path = ctx.root / "workdir-file"
  path.write_text("x")
  proc = command("train.main", "--config=configs/tiny.py", "--config.steps=2", f"--workdir={path}")
  return outcome(proc, must_fail("trained into a file"), must=["workdir-file", "not a directory"])


# ----------------------------------------------------------------------------------------------------------------
# Data


def token_file(ctx: Context, name: str, tokens: Sequence[int], vocab: int, meta: str | None = None) -> pathlib.Path:
  import numpy as np  # noqa: PLC0415
  path = ctx.root / name
  np.asarray(tokens, np.uint16).tofile(path)
  pathlib.Path(f"{path}.json").write_text(meta if meta is not None else json.dumps(
      {"dtype": "uint16", "vocab_size": vocab, "num_tokens": len(tokens)}))
  return path


def tokens_past_vocab(ctx: Context) -> Outcome:
  path = token_file(ctx, "past.bin", [i % 10 for i in range(20_000)], vocab=5)
  proc = command("train.main", *ctx.micro("--config.data.source=tokens", f"--config.data.path={path}"),
                 f"--workdir={ctx.root / 'tok1'}")
  return outcome(proc, must_fail("trained on ids past the vocabulary"), must=["past.bin", "9"])


def tokens_bad_json(ctx: Context) -> Outcome:
  path = token_file(ctx, "badjson.bin", [1] * 20_000, vocab=5, meta="{garbage")
  proc = command("train.main", *ctx.micro("--config.data.source=tokens", f"--config.data.path={path}"),
                 f"--workdir={ctx.root / 'tok2'}")
  return outcome(proc, must_fail("trained without a token description"), must=["badjson.bin.json"])


def one_file_corpus(ctx: Context) -> Outcome:
  path = ctx.root / "one.py"
  path.write_text("x = 1\n" * 400)
  proc = command("train.main", *ctx.micro(f"--config.data.path={path}"), f"--workdir={ctx.root / 'one'}")
  result = outcome(proc, must_fail("trained without validation data"), must=["one-file"])
  if proc.error_lines and "raise data.val_fraction" in proc.error_lines[0]:
    return Outcome("unclear", "advises raising data.val_fraction, which cannot help a one-file corpus")
  return result


def data_cli_missing_path(ctx: Context) -> Outcome:
  proc = command("train.data", ctx.root / "tokens-out", ctx.root / "no-such-text")
  return outcome(proc, must_fail("wrote token files from nothing"), must=["no-such-text"])


def plot_without_metrics(ctx: Context) -> Outcome:
  folder = ctx.root / "empty-run"
  folder.mkdir(exist_ok=True)
  proc = command("train.plot", folder)
  return outcome(proc, must_fail("plotted nothing"), must=["metrics.jsonl"])


def plot_cut_metrics(ctx: Context) -> Outcome:
  work = ctx.copy()
  path = work / "metrics.jsonl"
  path.write_text(path.read_text() + '{"step": 13, "lo')
  proc = command("train.plot", work, "--out", work / "curves.png")
  return outcome(proc, lambda p: None if (work / "curves.png").stat().st_size > 0 else "no PNG written")


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face folders as init_from


def hf_damaged(damage: Callable[[pathlib.Path], str], must: Callable[[pathlib.Path], Sequence[str]]):
  """Damage a copy of the micro run's Hugging Face export and train from it (init_from)."""
  def run(ctx: Context) -> Outcome:
    folder = ctx.hf_copy()
    why = damage(folder)
    proc = command("train.main", *ctx.micro("--config.steps=2", "--config.warmup_steps=1",
                                            f"--config.init_from={folder}"), f"--workdir={folder}-run")
    return outcome(proc, must_fail(f"trained from {why}"), must=must(folder))
  return run


def _retype(name_part: str, dtype: str):
  def damage(folder: pathlib.Path) -> str:
    import numpy as np  # noqa: PLC0415
    from safetensors.numpy import load_file, save_file  # noqa: PLC0415
    path = next(folder.glob("*.safetensors"))
    tensors = load_file(path)
    name = next(n for n in sorted(tensors) if name_part in n)
    value = tensors[name]
    tensors[name] = {"nan": lambda v: np.where(np.arange(v.size).reshape(v.shape) == 3, np.nan, v).astype(v.dtype),
                     "int32": lambda v: (v * 100).astype(np.int32), "bool": lambda v: v > 0}[dtype](value)
    save_file(tensors, path, metadata={"format": "pt"})
    return f"{name} as {dtype}"
  return damage


def _tensor_named(name_part: str):
  def names(folder: pathlib.Path) -> list[str]:
    from safetensors.numpy import load_file  # noqa: PLC0415
    return [next(n for n in sorted(load_file(next(folder.glob("*.safetensors")))) if name_part in n)]
  return names


def _truncate_weights(folder: pathlib.Path) -> str:
  _truncate(next(folder.glob("*.safetensors")))
  return "a truncated safetensors file"


def _config_edit(edit: Callable[[dict], None]):
  def damage(folder: pathlib.Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    return "an edited config.json"
  return damage


# ----------------------------------------------------------------------------------------------------------------
# Library calls (in this process)


LOW_BIT = ("adamw_8bit", "adamw_4bit", "adamw_fp8", "adamw_fp8_o2")


def huge_gradient(name: str, big: float = 1e25) -> Callable[[Context], Outcome]:
  def run(ctx: Context) -> Outcome:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from jaxlowbit import optim  # noqa: PLC0415

    def call():
      tx = optim.make(name, 1e-3, weight_decay=0.0)
      params = {"w": jnp.zeros((16, 512))}
      grads = {"w": jnp.full((16, 512), 1e-3).at[3, 5].set(big)}
      updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
      return updates, state

    def check(result) -> str | None:
      bad = sum(int(np.size(x) - np.isfinite(np.asarray(x, np.float32)).sum()) for x in jax.tree.leaves(result))
      return f"{bad} non-finite values in the update and state (optax.adamw stays finite)" if bad else None
    return library(call, check)
  return run


def foreign_state(optimizer: str, given: str) -> Callable[[Context], Outcome]:
  def run(ctx: Context) -> Outcome:
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415

    from jaxlowbit import optim  # noqa: PLC0415
    params = {"w": jnp.ones((8, 1024))}
    state = optim.make(given, 1e-3).init(params)
    tx = optax.adamw(1e-3) if optimizer == "optax.adamw" else optim.make(optimizer, 1e-3)
    return library(lambda: tx.update(params, state, params), lambda r: f"{optimizer}.update took {given}'s state",
                   must=[given])
  return run


def pack_2bit_out_of_range(ctx: Context) -> Outcome:
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from jaxlowbit_numerics import ternary  # noqa: PLC0415
  values = jnp.asarray([2, -2, 3, 1], jnp.int8)

  def check(packed) -> str | None:
    back = np.asarray(ternary.unpack_2bit(packed, 4)) if hasattr(ternary, "unpack_2bit") else None
    return f"packed values outside {{-1, 0, 1}} (unpacks to {back})"
  return library(lambda: ternary.pack_2bit(values), check, must=["2"])


def quantize_empty(ctx: Context) -> Outcome:
  import jax.numpy as jnp  # noqa: PLC0415

  from jaxlowbit_numerics import int8  # noqa: PLC0415
  return library(lambda: int8.quantize_int8(jnp.zeros((4, 0)), axis=-1),
                 lambda r: "quantized an empty slice (scale of nothing)", must=["empty"])


def int8_dense_features(features: int) -> Callable[[Context], Outcome]:
  def run(ctx: Context) -> Outcome:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    import jaxlowbit  # noqa: PLC0415
    return library(lambda: jaxlowbit.Int8Dense(features).init(jax.random.key(0), jnp.ones((2, 32))),
                   lambda r: f"built a layer of {features} features", must=["features"])
  return run


def state_without_target(ctx: Context) -> Outcome:
  import jax.numpy as jnp  # noqa: PLC0415
  import orbax.checkpoint as ocp  # noqa: PLC0415

  from jaxlowbit import optim  # noqa: PLC0415
  tx = optim.adamw_8bit(1e-3)
  params = {"w": jnp.ones((8, 1024))}
  path = ctx.root / "opt-state"
  saver = ocp.StandardCheckpointer()
  saver.save(path, tx.init(params))
  saver.wait_until_finished()
  restored = saver.restore(path)
  return library(lambda: tx.update(params, restored, params), lambda r: "updated with a state of unknown format",
                 must=["target"])


def rounding_seed(ctx: Context) -> Outcome:
  from jaxlowbit import optim  # noqa: PLC0415
  return library(lambda: optim.make("adamw_8bit", 1e-3, stochastic_rounding_seed="x"),
                 lambda r: "accepted seed 'x'", must=["seed"])


def convert_unmatched_filter(ctx: Context) -> Outcome:
  import warnings  # noqa: PLC0415

  import flax.linen as nn  # noqa: PLC0415
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  import jaxlowbit  # noqa: PLC0415

  def call():
    model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(32)])
    model = jaxlowbit.convert(model, jaxlowbit.Int8MixedPrecision(), filter_fqns=("lm_head",))
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      model.init(jax.random.key(0), jnp.ones((16, 64), jnp.bfloat16))
    return [str(w.message) for w in caught]
  return library(call, lambda found: None if any("lm_head" in w for w in found) else
                 "filter_fqns=('lm_head',) matched no layer and nothing warned")


# ----------------------------------------------------------------------------------------------------------------
# Newcomer frictions


def run_summary(ctx: Context) -> Outcome:
  proc = ctx.run_proc
  text = proc.out + proc.err
  wanted = ["summary:", "checkpoints/12", "train.generate", "train.plot", "train.hf export", "validation loss"]
  missing = [w for w in wanted if w not in text]
  return Outcome("silent", f"the run ends without {missing}") if missing else Outcome("handled", "summary printed")


def docs_tensor_parallel(ctx: Context) -> Outcome:
  text = (REPO / "docs" / "training.md").read_text()
  section = text.split("## Tensor parallelism", 1)[-1].split("\n## ", 1)[0]
  blocks = section.split("```")[1::2]
  commands = [b for b in blocks if "train.main" in b]
  if not commands:
    return Outcome("silent", "no train.main command in the tensor-parallel section")
  problems = [p for p, ok in (("no --workdir", all("--workdir" in c for c in commands)),
                              ("no way to 8 CPU devices", "xla_force_host_platform_device_count" in section)) if not ok]
  return Outcome("silent", "; ".join(problems)) if problems else Outcome("handled", "--workdir and 8 CPU devices")


def recipe_lists(ctx: Context) -> Outcome:
  from train import config as train_config  # noqa: PLC0415
  names = [n for n in train_config.RECIPES if n != "bf16"]
  missing = {doc: [n for n in names if f"`{n}`" not in (REPO / doc).read_text()]
             for doc in ("README.md", "docs/training.md")}
  missing = {doc: names for doc, names in missing.items() if names}
  return Outcome("silent", f"recipes not listed: {missing}") if missing else Outcome("handled", "every recipe listed")


def readme_filter(ctx: Context) -> Outcome:
  """The README's first example converts a Sequential and filters its head: the name must be one Flax gives it."""
  text = (REPO / "README.md").read_text()
  block = text.split("```python", 1)[1].split("```", 1)[0]
  if "nn.Sequential" not in block:
    return Outcome("handled", "no Sequential in the first example")
  if "filter_fqns=(\"lm_head\"" in block or "filter_fqns=('lm_head'" in block:
    return Outcome("silent", "filters lm_head inside nn.Sequential (Flax names it layers_2)")
  return Outcome("handled", "filters a layer the Sequential has")


# ----------------------------------------------------------------------------------------------------------------


def _cases() -> list[Case]:
  cases = []
  for name, damage in DAMAGE.items():
    cases.append(Case(f"resume: newest checkpoint {name}", "silent",
                      "damage checkpoint 12 of the micro run, --resume; check: moved aside, 12 saved again and "
                      "verified, steps 9-12 log the uninterrupted run's losses", damaged_resume(damage)))
  cases += [
      Case("resume twice after a bit flip", "silent", "damage 12, --resume, --resume: the second says finished",
           resume_twice_after_damage),
      Case("resume: every checkpoint damaged", "drill", "exit 4, one line, nothing moved", every_checkpoint_damaged),
      Case("generate: newest checkpoint corrupt", "silent", "warning, reads 8: the text equals checkpoint 8's",
           reader_of_corrupt_newest("generate")),
      Case("export: newest checkpoint corrupt", "silent", "refused, naming 12 and --step 8",
           reader_of_corrupt_newest("export")),
      Case("generate --step 12 (corrupt)", "drill", "one line naming step 8",
           reader_step("generate", 12, True, ["corrupt", "step 8"])),
      Case("export --step 999", "unclear", "one line", reader_step("export", 999, False, ["999"])),
      Case("generate --step 999", "unclear", "one line", reader_step("generate", 999, False, ["999"])),
      Case("export --checkpoint missing", "unclear", "one line naming it", reader_missing_run("export")),
      Case("generate --checkpoint missing", "unclear", "one line naming it", reader_missing_run("generate")),
      Case("export --dtype int8", "silent", "one line pointing to --scheme; check of exit 0: all-zero matrices",
           export_int8_dtype),
      Case("export --out under a file", "unclear", "one line naming the file", export_out_under_a_file),
      Case("export --out read-only", "unclear", "one line", export_out_read_only),
      Case("export safetensors, disk full (ulimit -f)", "unclear", "one line naming --out, no partial file",
           export_disk_full("safetensors")),
      Case("export gguf, disk full (ulimit -f)", "unclear", "one line naming --out, no partial file",
           export_disk_full("gguf")),
      Case("resume: garbage config.json", "unclear", "one line naming config.json", resume_bad_config_json("{x")),
      Case("resume: empty config.json", "unclear", "one line naming config.json", resume_bad_config_json("")),
      Case("resume: [] config.json", "unclear", "one line naming config.json", resume_bad_config_json("[]")),
      Case("resume: half-written last metrics line", "unclear", "resumes; steps 9-12 log the same losses",
           resume_cut_metrics),
      Case("resume: damaged metrics line 3", "unclear", "one line naming metrics.jsonl and line 3",
           resume_bad_metrics_line),
      Case("resume: another config (config.json deleted)", "unclear", "one line, short stderr", resume_other_config),
      Case("resume: d_model changed", "drill", "one line naming model.d_model", resume_shape_change),
      Case("resume: run already finished", "drill", "exit 0, says so", resume_finished),
      Case("workdir with checkpoints, no --resume", "drill", "one line pointing to --resume",
           workdir_with_checkpoints_no_resume),
      Case("two SIGINTs 5 ms apart, then --resume", "silent", "exit 130; resumed run logs every loss bit for bit",
           interrupted((signal.SIGINT, signal.SIGINT), 0.005, 130)),
      Case("SIGTERM, then --resume", "drill", "exit 143; resumed run logs every loss bit for bit",
           interrupted((signal.SIGTERM,), 0.0, 143)),
      Case("SIGKILL, then --resume", "silent", "every committed checkpoint verifies; same losses",
           sigkill_then_resume),
  ]
  config_cases = [
      ("--config.lr=nan", ["config.lr"], "unclear"), ("--config.lr=inf", ["config.lr"], "unclear"),
      ("--config.weight_decay=nan", ["config.weight_decay"], "unclear"),
      ("--config.model.init_std=nan", ["config.model.init_std"], "unclear"),
      ("--config.grad_clip=nan", ["config.grad_clip"], "silent"), ("--config.eps=1e30", ["config.eps"], "silent"),
      ("--config.model.norm_eps=1e30", ["config.model.norm_eps"], "silent"),
      ("--config.peak_tflops=nan", ["config.peak_tflops"], "silent"), ("--config.b2=1.0", ["config.b2"], "drill"),
      ("--config.optimizer=chain", ["config.optimizer"], "unclear"),
      ("--config.optimizer=stochastic_rounding", ["config.optimizer"], "unclear"),
      ("--config.seed=-1", ["config.seed"], "unclear"), (f"--config.seed={2**70}", ["config.seed"], "unclear"),
      ("--config.model.rope_scaling=abc", ["config.model.rope_scaling"], "unclear"),
      ("--config.lr=-1", ["config.lr"], "drill"), ("--config.grad_accum_steps=0", ["grad_accum_steps"], "drill"),
      ("--config.model.dropout_rate=1.5", ["dropout_rate"], "drill"), ("--config.recipe=int4", ["config.recipe"], "drill"),
      ("--config.model.n_heads=3", ["n_heads"], "drill"),
  ]
  for override, must, source in config_cases:
    cases.append(Case(f"config {override.removeprefix('--config.')}", source, "one line naming the field, before any "
                      "output", config_value(override, must), cheap=True))
  cases += [
      Case("misspelled override model.d_modl", "friction", "one plain line with the hint", misspelled_override,
           cheap=True),
      Case("--config missing file", "unclear", "one line naming it", missing_config_file, cheap=True),
      Case("--config with a syntax error", "drill", "one line naming it", config_syntax_error, cheap=True),
      Case("--workdir is a file", "unclear", "one line naming it", workdir_is_a_file, cheap=True),
      Case("token ids past the vocabulary", "unclear", "one line naming the file and the id", tokens_past_vocab),
      Case("token file with garbage .json", "unclear", "one line naming the .json", tokens_bad_json),
      Case("one-file text corpus", "unclear", "advice that can work (not 'raise data.val_fraction')",
           one_file_corpus),
      Case("train.data on a missing path", "unclear", "one line naming it", data_cli_missing_path, cheap=True),
      Case("train.plot without metrics", "unclear", "one line naming metrics.jsonl", plot_without_metrics, cheap=True),
      Case("train.plot, half-written last metrics line", "unclear", "plots", plot_cut_metrics),
      Case("init_from: a tensor stored as int32", "silent", "one line naming the tensor",
           hf_damaged(_retype("q_proj", "int32"), _tensor_named("q_proj"))),
      Case("init_from: a tensor stored as bool", "silent", "one line naming the tensor",
           hf_damaged(_retype("q_proj", "bool"), _tensor_named("q_proj"))),
      Case("init_from: NaN in a tensor", "unclear", "one line naming the tensor",
           hf_damaged(_retype("q_proj", "nan"), _tensor_named("q_proj"))),
      Case("init_from: truncated safetensors", "unclear", "one line naming the file",
           hf_damaged(_truncate_weights, lambda f: [next(f.glob("*.safetensors")).name])),
      Case("init_from: config.json without hidden_size", "unclear", "one line naming config.json and the key",
           hf_damaged(_config_edit(lambda c: c.pop("hidden_size")), lambda f: ["config.json", "hidden_size"])),
      Case("init_from: num_attention_heads=0", "unclear", "one line naming the key",
           hf_damaged(_config_edit(lambda c: c.update(num_attention_heads=0)), lambda f: ["num_attention_heads"])),
  ]
  for name in LOW_BIT:
    cases.append(Case(f"{name}: one gradient of 1e25", "silent", "update and state finite (as optax.adamw's)",
                      huge_gradient(name), cheap=True))
  cases.append(Case("adamw_8bit: one gradient of 1e20", "silent", "update and state finite (8-bit failed from 1e20)",
                    huge_gradient("adamw_8bit", 1e20), cheap=True))
  cases += [
      Case("adamw_4bit.update(adamw_8bit state)", "silent", "TypeError naming both",
           foreign_state("adamw_4bit", "adamw_8bit"), cheap=True),
      Case("optax.adamw.update(adamw_8bit state)", "silent", "an error naming adamw_8bit",
           foreign_state("optax.adamw", "adamw_8bit"), cheap=True),
      Case("optax.adamw.update(adamw_fp8 state)", "silent", "an error naming adamw_fp8",
           foreign_state("optax.adamw", "adamw_fp8"), cheap=True),
      Case("pack_2bit([2, -2, 3, 1])", "silent", "an error naming the value", pack_2bit_out_of_range, cheap=True),
      Case("quantize_int8 of an empty array", "unclear", "an error saying empty", quantize_empty, cheap=True),
      Case("Int8Dense(0)", "unclear", "an error naming features", int8_dense_features(0), cheap=True),
      Case("Int8Dense(-1)", "unclear", "an error naming features", int8_dense_features(-1), cheap=True),
      Case("optimizer state restored without a target", "unclear", "an error saying to restore with a target",
           state_without_target, cheap=True),
      Case("stochastic_rounding_seed='x'", "unclear", "an error naming the seed", rounding_seed, cheap=True),
      Case("convert: filter_fqns matching no layer", "friction", "a warning naming the entry",
           convert_unmatched_filter, cheap=True),
      Case("README first example's filter", "friction", "filters a layer the Sequential has", readme_filter,
           cheap=True),
      Case("run summary", "friction", "the run ends with checkpoint path and next commands", run_summary),
      Case("docs: tensor-parallel example", "friction", "--workdir and how to get 8 CPU devices",
           docs_tensor_parallel, cheap=True),
      Case("docs: recipe lists", "friction", "every recipe in README and docs/training.md", recipe_lists, cheap=True),
  ]
  return cases


CASES = _cases()


def run_cases(cases: Sequence[Case], root: pathlib.Path, verbose: bool = True) -> list[tuple[Case, Outcome, float]]:
  ctx = Context(root)
  results = []
  for case in cases:
    start = time.monotonic()
    try:
      result = case.run(ctx)
    except Exception as e:  # noqa: BLE001  (the battery itself failed on this case: counted, not hidden)
      result = Outcome("unclear", f"the case itself failed: {type(e).__name__}: {str(e)[:200]}")
    seconds = time.monotonic() - start
    results.append((case, result, seconds))
    if verbose:
      print(f"{result.kind:8s} {seconds:5.1f}s  {case.name}: {result.detail}", flush=True)
  return results


def table(results) -> str:
  lines = ["| case | from | outcome | detail |", "| --- | --- | --- | --- |"]
  for case, result, _ in results:
    lines.append(f"| {case.name} | {case.source} | {result.kind} | {result.detail.replace('|', '/')} |")
  counts = {kind: sum(r.kind == kind for _, r, _ in results) for kind in KINDS}
  lines.append("")
  lines.append(" / ".join(f"{kind} {count}" for kind, count in counts.items()) + f" (of {len(results)})")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--only", nargs="*", default=[], help="run the cases whose name holds one of these")
  parser.add_argument("--cheap", action="store_true", help="only the cases that need no trained run")
  parser.add_argument("--list", action="store_true", help="list the cases and exit")
  parser.add_argument("--out", default=None, help="write the results as JSON here")
  parser.add_argument("--keep", default=None, help="work in this folder (kept) instead of a temporary one")
  args = parser.parse_args(argv)
  cases = [c for c in CASES if (not args.only or any(s in c.name for s in args.only)) and (c.cheap or not args.cheap)]
  if args.list:
    for case in cases:
      print(f"{case.source:8s} {case.name}: {case.what}")
    return 0
  with tempfile.TemporaryDirectory(prefix="hostile-") as tmp:
    root = pathlib.Path(args.keep) if args.keep else pathlib.Path(tmp)
    root.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    results = run_cases(cases, root)
  print()
  print(table(results))
  print(f"\n{len(results)} cases in {time.monotonic() - start:.0f} s")
  if args.out:
    pathlib.Path(args.out).write_text(json.dumps(
        [{"case": c.name, "from": c.source, "outcome": r.kind, "detail": r.detail, "seconds": round(s, 1)}
         for c, r, s in results], indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
