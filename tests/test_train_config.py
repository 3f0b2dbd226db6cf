"""train.config and configs/*.py: override parsing, recipe names, presets, optimizer construction."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import ml_collections
import pytest
from absl import flags
from ml_collections import config_flags

from jaxlowbit import BitNet, Float8, Int8MixedPrecision
from train import config as train_config
from train import optimizer as train_optimizer
from train.model import param_count
from train.spec import UNSHARDED, build

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
RECIPE_FILES = {"bf16": "bf16", "int8": "int8", "fp8": "fp8_tensorwise", "bitnet": "bitnet"}


def _parse(argv):
  flag_values = flags.FlagValues()
  argv = ["prog", *argv]
  holder = config_flags.DEFINE_config_file(
      "config", None, "config file", flag_values=flag_values, lock_config=True, sys_argv=argv
  )
  flag_values(argv)
  return holder.value


def test_command_line_overrides_are_typed():
  config = _parse([
      f"--config={CONFIGS / 'tiny.py'}",
      "--config.recipe=int8",
      "--config.model.n_layers=3",
      "--config.lr=0.01",
      "--config.model.filter_fqns=attn.out,lm_head",
      "--config.model.tie_embeddings=True",
      "--config.peak_tflops=989",
  ])
  assert config.recipe == "int8" and config.model.n_layers == 3 and config.lr == 0.01
  assert config.model.tie_embeddings is True and config.peak_tflops == 989.0
  model = train_config.model_config(config)
  assert model.recipe == Int8MixedPrecision() and model.filter_fqns == ("attn.out", "lm_head")
  assert model.dtype == jnp.bfloat16 and model.param_dtype == jnp.float32


def test_bad_overrides_are_rejected():
  with pytest.raises(flags.IllegalFlagValueError):
    _parse([f"--config={CONFIGS / 'tiny.py'}", "--config.steps=many"])
  with pytest.raises((KeyError, AttributeError, flags.Error)):
    _parse([f"--config={CONFIGS / 'tiny.py'}", "--config.no_such_field=1"])


def test_recipe_names():
  assert train_config.recipe_from_name("bf16") is None
  assert train_config.recipe_from_name("fp8_rowwise") == Float8("rowwise")
  assert train_config.recipe_from_name("fp8_rowwise_gw_hp") == Float8("rowwise_gw_hp")
  assert train_config.recipe_from_name("bitnet_int8_bwd") == BitNet(grad_input=True, grad_weight=True)
  with pytest.raises(ValueError, match="fp8_tensorwise"):  # the message lists the choices
    train_config.recipe_from_name("fp4")
  config = train_config.base_config()
  config.model.dtype = "float64"
  with pytest.raises(ValueError, match="bfloat16"):
    train_config.model_config(config)


def test_check_rejects_inconsistent_fields():
  config = train_config.base_config()
  config.grad_accum_steps = 3
  with pytest.raises(ValueError, match="multiple of grad_accum_steps"):
    train_config.check(config)
  config = train_config.base_config()
  config.warmup_steps = config.steps + 1
  with pytest.raises(ValueError, match="warmup_steps"):
    train_config.check(config)


# Model fields a preset sets besides its recipe: BitNet ships the published b1.58 2B4T form.
PRESET_MODEL_FIELDS = {"bitnet": {"bitnet_norm_placement": "sub", "tie_embeddings": True}}
# Other fields a preset of one size sets: BitNet's 125M learning rate (configs/bitnet_125m.py says why).
PRESET_FIELDS = {("bitnet", "125m"): {"lr": 2e-3}}


@pytest.mark.parametrize("size,low,high", [("1b", 0.9e9, 1.1e9), ("125m", 1.0e8, 1.5e8), ("8b", 6.5e9, 7.5e9)])
def test_presets_share_one_base_and_differ_only_in_recipe_and_listed_fields(size, low, high):
  configs = {name: train_config.load_file(CONFIGS / f"{name}_{size}.py") for name in RECIPE_FILES}
  base = configs["bf16"].to_dict()
  for name, config in configs.items():
    train_config.check(config)
    assert config.recipe == RECIPE_FILES[name]
    model = {**base["model"], **PRESET_MODEL_FIELDS.get(name, {})}
    assert {**config.to_dict(), "recipe": "bf16"} == {**base, **PRESET_FIELDS.get((name, size), {}), "model": model}
  assert low < param_count(train_config.model_config(configs["bf16"]))["total"] < high


def test_load_file_overrides():
  config = train_config.load_file(CONFIGS / "tiny.py", {"model.d_model": 32, "steps": 3})
  assert config.model.d_model == 32 and config.steps == 3
  with pytest.raises(KeyError, match="model.width"):
    train_config.load_file(CONFIGS / "tiny.py", {"model.width": 32})


def test_config_json_round_trips():
  config = train_config.load_file(CONFIGS / "tiny.py")
  import json

  assert json.loads(train_config.to_json(config))["model"]["d_model"] == config.model.d_model


def test_optimizer_schedule_mask_and_clipping():
  config = train_config.base_config()
  config.update(lr=1e-3, warmup_steps=10, steps=110, min_lr_ratio=0.1)
  schedule = train_optimizer.learning_rate_schedule(build(config, UNSHARDED))
  np.testing.assert_allclose(float(schedule(0)), 1e-4, rtol=1e-6)  # the first step moves: lr / warmup
  np.testing.assert_allclose(float(schedule(5)), 5.5e-4, rtol=1e-5)
  np.testing.assert_allclose(float(schedule(10)), 1e-3, rtol=1e-6)
  np.testing.assert_allclose(float(schedule(60)), 0.55e-3, rtol=1e-5)  # half-way down the cosine
  np.testing.assert_allclose(float(schedule(110)), 1e-4, rtol=1e-5)
  config.update(warmup_steps=110)  # warm-up over the whole run: no cosine phase (optax refuses an empty one)
  warm_only = train_optimizer.learning_rate_schedule(build(config, UNSHARDED))
  for step in (0, 55, 109):  # the same ramp as with a cosine phase: lr / warmup + (lr - lr / warmup) * step / warmup
    np.testing.assert_allclose(float(warm_only(step)), 1e-3 / 110 + (1e-3 - 1e-3 / 110) * step / 110, rtol=1e-5)

  params = {"layers": {"attn_norm": {"scale": jnp.ones((2, 4))}, "qkv": {"kernel": jnp.ones((2, 4, 4))}},
            "embed": {"embedding": jnp.ones((8, 4))}}
  mask = train_optimizer.weight_decay_mask(params)
  assert mask == {"layers": {"attn_norm": {"scale": False}, "qkv": {"kernel": True}}, "embed": {"embedding": True}}

  # Only weight decay moves parameters when gradients are zero: norm scales must not move.
  config.update(lr=1.0, warmup_steps=0, weight_decay=0.5, grad_clip=1.0)
  opt = train_optimizer.make_optimizer(build(config, UNSHARDED))
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = opt.update(zeros, opt.init(params), params)
  assert float(jnp.abs(updates["layers"]["attn_norm"]["scale"]).max()) == 0.0
  assert float(jnp.abs(updates["layers"]["qkv"]["kernel"]).max()) > 0.0
  # Clipping: a huge gradient is scaled to global norm grad_clip before Adam (whose update is then ~lr).
  huge = jax.tree.map(lambda p: 1e6 * jnp.ones_like(p), params)
  clipped, _ = optax.clip_by_global_norm(1.0).update(huge, optax.EmptyState())
  np.testing.assert_allclose(float(optax.tree.norm(clipped)), 1.0, rtol=1e-5)


def test_optimizer_names_come_from_the_jaxlowbit_optim_registry(monkeypatch):
  config = train_config.base_config()
  calls = []

  def adamw_8bit(learning_rate, execution=None, **kwargs):
    calls.append({"learning_rate": learning_rate, "execution": execution, **kwargs})
    return optax.adamw(learning_rate, **kwargs)

  assert train_optimizer.OPTIMIZERS is train_optimizer.optim.OPTIMIZERS  # one place for the names
  monkeypatch.setitem(train_optimizer.OPTIMIZERS, "adamw_8bit", adamw_8bit)
  config.optimizer = "adamw_8bit"
  train_optimizer.make_optimizer(build(config, UNSHARDED))
  assert calls and set(calls[0]) == {"learning_rate", "b1", "b2", "eps", "weight_decay", "mask", "execution"}
  assert calls[0]["execution"] == build(config, UNSHARDED).execution  # the run's options, explicitly
  # Functions of jaxlowbit.optim that are not optimizers, and unknown names: refused by the check, naming the list.
  for name in ("lion", "chain", "stochastic_rounding", "apply_step", "make"):
    config.optimizer = name
    with pytest.raises(ValueError, match=name):
      train_optimizer.make_optimizer(build(config, UNSHARDED))
    with pytest.raises(train_config.ConfigError, match=f"config.optimizer={name!r} is not an optimizer.*adamw_8bit"):
      train_config.check(config)


def _with(field, value):
  """The base config with ``field`` set to ``value`` of any type (built from a dict, as a config file or a
  resumed config.json can be: ConfigDict's own type checks only guard assignments)."""
  values = train_config.base_config().to_dict()
  *parents, leaf = field.split(".")
  parent = values
  for name in parents:
    parent = parent[name]
  parent[leaf] = value
  return ml_collections.ConfigDict(values)


def _refused(field, value, match=None):
  with pytest.raises(train_config.ConfigError, match=match or f"config.{field}"):
    train_config.check(_with(field, value))


def _accepted(field, value):
  train_config.check(_with(field, value))


@pytest.mark.parametrize("field, low, high, low_in, high_in", train_config.RANGES + train_config.OPTIONAL_RANGES,
                         ids=lambda v: v if isinstance(v, str) else "")
def test_every_range_is_enforced_at_both_bounds_and_only_finite_values_pass(field, low, high, low_in, high_in):
  (_accepted if low_in else _refused)(field, low)
  _refused(field, float(np.nextafter(low, -np.inf)))
  if not low_in:
    _accepted(field, float(np.nextafter(low, np.inf)))
  if high is not None:
    (_accepted if high_in else _refused)(field, high)
    _refused(field, float(np.nextafter(high, np.inf)))
    if not high_in:
      _accepted(field, float(np.nextafter(high, -np.inf)))
  for value in (float("nan"), float("inf"), float("-inf")):
    _refused(field, value, match=f"config.{field} must be a finite number")


def test_the_issue_31_values_are_refused_naming_the_field():
  for field, value in [("lr", float("nan")), ("lr", float("inf")), ("weight_decay", float("nan")),
                       ("grad_clip", float("nan")), ("eps", 1e30), ("model.norm_eps", 1e30),
                       ("model.init_std", float("nan")), ("peak_tflops", float("nan")), ("b2", 1.0),
                       ("seed", -1), ("seed", 2**70)]:
    _refused(field, value)
  _accepted("peak_tflops", None)
  _accepted("grad_clip", 0.0)  # clipping off


@pytest.mark.parametrize("field, low, high", train_config.INT_RANGES)
def test_integer_ranges_at_both_bounds(field, low, high):
  _accepted(field, low)
  _refused(field, low - 1)
  if high is not None:
    _accepted(field, high)
    _refused(field, high + 1)


def test_positive_integers_and_types():
  for field in train_config.POSITIVE_INTS + tuple(f"model.{f}" for f in train_config.POSITIVE_MODEL_INTS):
    _refused(field, 0)
    _refused(field, 1.5, match=f"config.{field} must be an integer")
  for field, value, kind in [("lr", "abc", "a number"), ("tensorboard", 1, "True or False"), ("recipe", 3, "a string"),
                             ("model.scan_layers", "yes", "True or False"), ("seed", True, "an integer"),
                             ("steps", 2.0, "an integer")]:
    _refused(field, value, match=f"config.{field} must be {kind}")


def test_rope_scaling_is_four_positive_numbers():
  _accepted("model.rope_scaling", "")
  _accepted("model.rope_scaling", "32.0,1.0,4.0,8192.0")
  for text in ("abc", "1,2,3", "1,2,3,abc", "32,1,4,0", "32,1,4,nan"):
    _refused("model.rope_scaling", text, match="config.model.rope_scaling=.*four positive numbers")


# Small widths that keep every config's structure (layers unrolled or scanned, heads grouped,
# microbatches, recipe) but compile in seconds on a CPU.
SMALL = {"model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2, "model.d_ff": 128,
         "seq_len": 32, "mesh.fsdp": 1, "data.source": "synthetic"}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.py")), ids=lambda p: p.stem)
def test_every_config_loads_and_its_step_compiles_at_small_width(path):
  from train import data, spec, steps

  config = train_config.load_file(path)
  train_config.check(config)
  config = train_config.load_file(path, {**SMALL, "batch_size": 2 * config.grad_accum_steps})
  functions = steps.step_functions(spec.resolve(config))
  state = jax.eval_shape(functions.init)
  batch = functions.shard_train_batch(data.SyntheticBatches(config.seq_len, config.batch_size, 0).next())
  compiled = functions.train_step.lower(state, batch).compile()
  assert compiled.as_text()  # the whole step (model, recipe, optimizer) compiled


def test_fsdp_grad_reduce_dtype_is_a_closed_choice_recorded_in_the_spec():
  config = train_config.load_file(CONFIGS / "tiny.py")
  assert build(config, UNSHARDED).fsdp.grad_reduce_dtype == "float32"  # default: exact float32 sums
  config.fsdp.grad_reduce_dtype = "bfloat16"
  train_config.check(config)
  assert build(config, UNSHARDED).fsdp.grad_reduce_dtype == "bfloat16"
  config.fsdp.grad_reduce_dtype = "float16"
  with pytest.raises(train_config.ConfigError, match=r"config.fsdp.grad_reduce_dtype='float16'.*bfloat16"):
    train_config.check(config)


def test_xla_overlap_options_reach_multi_gpu_steps_only():
  from types import SimpleNamespace

  from jaxlowbit.parallel import overlap

  gpus = [SimpleNamespace(platform="gpu")] * 2
  assert overlap.compiler_options(gpus) == dict(overlap.GPU_OVERLAP_OPTIONS)
  assert overlap.compiler_options(gpus, enabled=False) == {}
  assert overlap.compiler_options(gpus[:1]) == {}  # one GPU: nothing to overlap
  assert overlap.compiler_options(jax.devices()[:2]) == {}  # CPUs: no effect
  assert overlap.xla_flags().split() == [f"--{name}=true" for name in overlap.GPU_OVERLAP_OPTIONS]
  # Every name is a field of this jaxlib's XLA DebugOptions: a CPU compile accepts (and ignores) them,
  # while a name XLA does not know fails the compile.
  x = jnp.arange(4.0)
  np.testing.assert_array_equal(jax.jit(lambda x: x + 1, compiler_options=overlap.GPU_OVERLAP_OPTIONS)(x), x + 1)
  with pytest.raises(Exception, match="xla_gpu_enable_async_all_gather"):  # the removed flag of older XLA
    jax.jit(lambda x: x + 2, compiler_options={"xla_gpu_enable_async_all_gather": True})(x)


def test_xla_overlap_drops_the_options_this_xla_does_not_know():
  """jax 0.11.2's XLA no longer knows the pipelined all-gather option: the step must still compile."""
  from jaxlowbit.parallel import overlap

  options = {"xla_gpu_enable_latency_hiding_scheduler": True, "xla_gpu_enable_async_all_gather": True}
  with pytest.warns(UserWarning, match="xla_gpu_enable_async_all_gather"):
    known = overlap.known_options(options)
  assert known == {"xla_gpu_enable_latency_hiding_scheduler": True}
  x = jnp.arange(4.0)
  np.testing.assert_array_equal(jax.jit(lambda x: x + 1, compiler_options=known)(x), x + 1)


def test_xla_overlap_is_a_mesh_choice_recorded_in_the_spec():
  from train import spec, steps

  config = train_config.load_file(CONFIGS / "tiny.py", {**SMALL, "mesh.fsdp": 2, "batch_size": 4})
  resolved = spec.resolve(config)
  assert resolved.xla_overlap is True  # the default
  assert steps.step_functions(resolved).compiler_options == {}  # CPU devices: XLA's defaults
  config.mesh.xla_overlap = False
  assert spec.resolve(config).xla_overlap is False
  with pytest.raises(TypeError, match="xla_overlap"):  # the ConfigDict keeps the field a bool
    config.mesh.xla_overlap = "yes"


def test_layers_8b_is_one_file_for_every_recipe():
  configs = {name: train_config.load_file(f"{CONFIGS / 'layers_8b.py'}:{recipe}")
             for name, recipe in RECIPE_FILES.items()}
  base = configs["bf16"].to_dict()
  assert train_config.load_file(CONFIGS / "layers_8b.py").to_dict() == base  # bf16 without an argument
  for name, config in configs.items():
    train_config.check(config)
    assert config.recipe == RECIPE_FILES[name]
    assert {**config.to_dict(), "recipe": "bf16"} == {**base, "model": {**base["model"], **PRESET_MODEL_FIELDS.get(
        name, {})}}
  model = train_config.model_config(configs["bf16"])
  assert (model.d_model, model.n_heads, model.n_kv_heads, model.d_ff, model.n_layers) == (4096, 32, 8, 14336, 4)
  assert param_count(model)["total"] == 875_597_824  # the count its docstring's memory budget uses
  with pytest.raises(train_config.ConfigError, match="fp4"):
    train_config.load_file(f"{CONFIGS / 'layers_8b.py'}:fp4")
