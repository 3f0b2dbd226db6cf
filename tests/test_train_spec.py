"""The run is resolved once: past ``train.spec``, the trainer reads a ``RunSpec``, never the raw ConfigDict.

Two proofs: a scan of ``train/``'s source (no module but ``config.py``, ``spec.py`` and the command
line ``main.py`` imports ml_collections at run time or calls the config's readers), and a micro run
trained, resumed, refused and loaded back with every ConfigDict field read recorded: each read made
by trainer code is made in ``train/config.py`` or ``train/spec.py``.
"""

import ast
import json
import pathlib
import sys

import ml_collections
import pytest
from test_train_loop import corpus, micro_config  # noqa: F401  (fixture)

from train import loop, runs
from train import config as train_config
from train.spec import UNSHARDED, build, from_saved, resolve

REPO = pathlib.Path(__file__).resolve().parents[1]
TRAIN = REPO / "train"
# The modules that may read a ConfigDict: the fields and their checks, the one conversion, and the command
# line that loads the --config file (absl's config_flags) and hands it to loop.train.
CONFIG_READERS = {TRAIN / "config.py", TRAIN / "spec.py"}
ENTRY_POINT = TRAIN / "main.py"
# train.config's functions that read a ConfigDict's fields (adjust is loop.train's first line: it rewrites the
# config before the spec is built, and is allowed).
FIELD_READERS = {"base_config", "check", "fsdp_config", "mesh_shape", "model_config", "to_json"}


def _runtime_imports(tree: ast.Module):
  """Import nodes outside ``if TYPE_CHECKING:`` blocks (annotations only)."""
  guarded = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      guarded |= {id(n) for n in ast.walk(node)}
  return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in guarded]


def test_no_train_module_but_config_and_spec_reads_a_config_dict_in_its_source():
  offenders = []
  for path in sorted(TRAIN.rglob("*.py")):
    if path in CONFIG_READERS or path == ENTRY_POINT:
      continue
    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(REPO)
    for node in _runtime_imports(tree):
      modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
      if any(m.split(".")[0] == "ml_collections" for m in modules):
        offenders.append(f"{where}:{node.lineno} imports ml_collections")
      if isinstance(node, ast.ImportFrom) and node.module == "train.config":
        offenders += [f"{where}:{node.lineno} imports {a.name}" for a in node.names if a.name in FIELD_READERS]
    for node in ast.walk(tree):
      if isinstance(node, ast.Attribute) and node.attr in FIELD_READERS and ast.unparse(node.value) == "train_config":
        offenders.append(f"{where}:{node.lineno} calls train_config.{node.attr}")
      if isinstance(node, ast.Name) and node.id == "ConfigDict":
        offenders.append(f"{where}:{node.lineno} names ConfigDict")
  assert not offenders, "\n".join(offenders)


@pytest.fixture
def config_reads(monkeypatch):
  """Every ConfigDict field read made while ``recording`` is on: the innermost ``train/`` file on the stack."""
  reads, state = [], {"recording": False}

  def record():
    if not state["recording"]:
      return
    frame = sys._getframe(2)
    while frame is not None:
      path = pathlib.Path(frame.f_code.co_filename).resolve()
      if path.is_relative_to(TRAIN):
        reads.append(f"{path.relative_to(REPO)}:{frame.f_lineno} ({frame.f_code.co_name})")
        return
      frame = frame.f_back

  for name in ("__getattr__", "__getitem__", "get"):
    original = getattr(ml_collections.ConfigDict, name)

    def patched(self, *args, _original=original, **kwargs):
      record()
      return _original(self, *args, **kwargs)

    monkeypatch.setattr(ml_collections.ConfigDict, name, patched)
  return reads, state


def test_a_run_trained_resumed_refused_and_loaded_reads_its_config_only_in_config_and_spec(
    tmp_path, corpus, config_reads  # noqa: F811
):
  reads, state = config_reads
  run_dir = tmp_path / "run"
  first = micro_config(corpus, steps=2, checkpoint_every=2, eval_every=2)
  resumed = micro_config(corpus, steps=4, checkpoint_every=2, eval_every=2, resume=True, lr=2e-2)  # a warning
  refused = micro_config(corpus, steps=6, resume=True, model__n_layers=2)  # other shapes: check_resumable
  state["recording"] = True
  assert loop.train(first, run_dir).status == "completed"
  assert loop.train(resumed, run_dir).step == 4
  with pytest.raises(train_config.ConfigError, match="model.n_layers 1 -> 2"):
    loop.train(refused, run_dir)
  spec, model, _, step = runs.load_run(run_dir)
  state["recording"] = False
  assert step == 4 and spec.optimizer.lr == 2e-2 and model == spec.model
  readers = {read.split(":")[0] for read in reads}
  assert readers and readers <= {"train/config.py", "train/spec.py"}, sorted(set(reads))
  assert "train/spec.py" in readers  # the recorder saw the one conversion


def test_config_json_is_the_spec_of_the_config_and_comes_back_as_the_same_spec(corpus):  # noqa: F811
  config = micro_config(corpus, recipe="int8")
  spec = resolve(config)
  assert json.loads(spec.config_json) == json.loads(train_config.to_json(config))  # the format of config.json
  saved = from_saved(json.loads(spec.config_json), spec.mesh)
  assert saved == spec and saved.config_json == spec.config_json
  # An older run's config.json lacks fields added since: they take their defaults.
  old = json.loads(spec.config_json)
  del old["grad_clip"], old["model"]["norm_eps"]
  assert from_saved(old) == build(config, UNSHARDED)
  # The text is not part of the spec's identity (the step functions' cache key).
  assert build(config, UNSHARDED).compiled == from_saved(old).compiled
