"""convert(): existing Linen models run quantized with unchanged parameter trees."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn

import jaxlowbit
from jaxlowbit import BitNet, Float8, Int8MixedPrecision
from helpers import fresh_key, sqnr_db


class Block(nn.Module):
  d: int

  def setup(self):
    self.up = nn.Dense(2 * self.d)
    self.down = nn.DenseGeneral(self.d)

  def __call__(self, x):
    return self.down(nn.gelu(self.up(x)))


class Model(nn.Module):
  d: int = 32

  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = x + Block(self.d, name=f"block_{i}")(x)
    return nn.Dense(10, name="lm_head")(x)

  def twice(self, x):
    return 2 * self(x)


def _count_lowbit_dots(fn, *args) -> int:
  text = str(jax.make_jaxpr(fn)(*args))
  return text.count("preferred_element_type=int32") + text.count("float8")


@pytest.mark.parametrize("recipe", [Int8MixedPrecision(), Float8("rowwise"), BitNet()], ids=str)
def test_convert_keeps_params_and_quantizes_every_dense(recipe):
  model = Model()
  x = jax.random.normal(fresh_key(), (4, 32))
  params = model.init(jax.random.key(0), x)
  qmodel = jaxlowbit.convert(model, recipe)
  assert isinstance(qmodel, Model) and qmodel.d == 32
  jax.tree.map(np.testing.assert_array_equal, params, qmodel.init(jax.random.key(0), x))
  out, ref = qmodel.apply(params, x), model.apply(params, x)
  assert 0 < sqnr_db(out, ref) < 200  # quantized: close, and not identical
  assert not np.array_equal(out, ref)
  # the other public methods run quantized too
  np.testing.assert_allclose(qmodel.apply(params, x, method="twice"), 2 * out, rtol=1e-6)
  grads = jax.grad(lambda p: jnp.sum(qmodel.apply(p, x) ** 2))(params)
  assert jax.tree.structure(grads) == jax.tree.structure(params)


def test_filter_fqns_and_counts():
  model = Model()
  x = jax.random.normal(fresh_key(), (4, 32))
  params = model.init(jax.random.key(0), x)
  apply = lambda m: (lambda p: m.apply(p, x))  # noqa: E731
  assert _count_lowbit_dots(apply(model), params) == 0
  assert _count_lowbit_dots(apply(jaxlowbit.convert(model, Int8MixedPrecision())), params) == 5
  assert _count_lowbit_dots(apply(jaxlowbit.convert(model, Int8MixedPrecision(), filter_fqns=("lm_head",))), params) == 4
  only_second = jaxlowbit.convert(model, Int8MixedPrecision(), filter_fqns=("block_0", "lm_head"))
  assert _count_lowbit_dots(apply(only_second), params) == 2
  # the unconverted module is untouched
  np.testing.assert_array_equal(model.apply(params, x), Model().apply(params, x))


def test_auto_filter_small_kn():
  assert not jaxlowbit.worth_quantizing(32, 64, Int8MixedPrecision())
  assert not jaxlowbit.worth_quantizing(4096, 1000, Int8MixedPrecision())  # N not a multiple of 16
  assert jaxlowbit.worth_quantizing(4096, 14336, Int8MixedPrecision())
  assert not jaxlowbit.worth_quantizing(4096, 2048, Float8("rowwise"))
  assert jaxlowbit.worth_quantizing(2048, 8192, Float8("tensorwise"))
  assert not jaxlowbit.worth_quantizing(1024, 4096, Float8("tensorwise"))
  model = Model()
  x = jax.random.normal(fresh_key(), (4, 32))
  params = model.init(jax.random.key(0), x)
  auto = jaxlowbit.convert(model, Int8MixedPrecision(), auto_filter_small_kn=True)
  assert _count_lowbit_dots(lambda p: auto.apply(p, x), params) == 0  # every layer is tiny
  np.testing.assert_array_equal(auto.apply(params, x), model.apply(params, x))


def test_converted_model_as_submodule_and_in_scan():
  inner = jaxlowbit.convert(Model(), Int8MixedPrecision())

  class Outer(nn.Module):
    inner: nn.Module

    @nn.compact
    def __call__(self, x):
      return self.inner(x) + 1

  x = jax.random.normal(fresh_key(), (4, 32))
  params = Model().init(jax.random.key(0), x)
  out = Outer(inner).apply({"params": {"inner": params["params"]}}, x)
  np.testing.assert_allclose(out, inner.apply(params, x) + 1, rtol=1e-6)

  class Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
      layers = nn.scan(
          nn.remat(lambda mdl, c, _: (mdl(c), None)),
          variable_axes={"params": 0}, split_rngs={"params": True}, length=3,
      )
      return layers(Block(32), x, None)[0]

  scanned = Scanned()
  sparams = scanned.init(jax.random.key(1), x)
  qscanned = jaxlowbit.convert(scanned, Int8MixedPrecision())
  assert _count_lowbit_dots(lambda p: qscanned.apply(p, x), sparams) == 2  # one scan body
  assert sqnr_db(qscanned.apply(sparams, x), scanned.apply(sparams, x)) > 20


def test_convert_errors():
  with pytest.raises(TypeError, match="flax.linen Module"):
    jaxlowbit.convert(lambda x: x, Int8MixedPrecision())
  with pytest.raises(TypeError, match="recipe"):
    jaxlowbit.convert(Model(), None)
  with pytest.raises(TypeError, match="sequence of strings"):
    jaxlowbit.convert(Model(), Int8MixedPrecision(), filter_fqns="lm_head")
  with pytest.raises(ValueError, match="empty string"):
    jaxlowbit.convert(Model(), Int8MixedPrecision(), filter_fqns=("",))
  with pytest.raises(TypeError, match="callable"):
    jaxlowbit.convert(Model(), Int8MixedPrecision(), filter_fn="lm_head")


def test_filter_fn_and_the_conversion_report():
  model, x = Model(), jnp.ones((4, 32))
  params = model.init(jax.random.key(0), x)
  keep_up = jaxlowbit.convert(model, Int8MixedPrecision(), filter_fqns=("lm_head",),
                              filter_fn=lambda path, module: path.endswith("up"))
  assert _count_lowbit_dots(lambda p: keep_up.apply(p, x), params) == 2  # the two `down` layers
  report = jaxlowbit.conversion_report(keep_up, x)
  rows = {layer.path: layer for layer in report.layers}
  assert set(rows) == {"block_0.up", "block_0.down", "block_1.up", "block_1.down", "lm_head"}
  assert [layer.path for layer in report.converted] == ["block_0.down", "block_1.down"]
  assert (rows["block_0.down"].k, rows["block_0.down"].n) == (64, 32)
  assert "filtered" in rows["lm_head"].reason and rows["lm_head"].recipe is None
  assert "2 of 5 Dense layers converted" in str(report)
  nothing = jaxlowbit.convert(model, Int8MixedPrecision(), auto_filter_small_kn=True)
  with pytest.warns(UserWarning, match="no Dense layer"):
    report = jaxlowbit.conversion_report(nothing, x, params=params["params"])
  assert all("too small" in layer.reason for layer in report.layers)


def test_methods_passed_to_apply_run_converted():
  # The original class's method, or a function reaching into a submodule, runs quantized too.
  model, x = Model(), jax.random.normal(fresh_key(), (4, 32))
  params = model.init(jax.random.key(0), x)
  qmodel = jaxlowbit.convert(model, Int8MixedPrecision())
  np.testing.assert_array_equal(qmodel.apply(params, x, method=Model.__call__), qmodel.apply(params, x))


  class Wrapper(nn.Module):
    def setup(self):
      self.block = Block(32)

    def __call__(self, x):
      return self.block(x)

  wrapper = Wrapper()
  wparams = wrapper.init(jax.random.key(1), x)
  qwrapper = jaxlowbit.convert(wrapper, Int8MixedPrecision())
  submodule = lambda m, x: m.block.up(x)  # noqa: E731  (a submodule's method, from outside)
  quantized, plain = qwrapper.apply(wparams, x, method=submodule), wrapper.apply(wparams, x, method=submodule)
  assert not np.array_equal(quantized, plain) and sqnr_db(quantized, plain) > 20


def test_a_filter_entry_that_matches_no_layer_warns_once_naming_the_paths():
  """The README's old mistake: ``name="lm_head"`` inside ``nn.Sequential`` is renamed ``layers_2``."""
  x = jnp.ones((2, 32))
  seq = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(16, name="lm_head")])
  model = jaxlowbit.convert(seq, Int8MixedPrecision(), filter_fqns=("lm_head", "layers_0"))
  with pytest.warns(UserWarning, match=r"convert: filter_fqns entry 'lm_head' matches no Dense layer of Sequential.*"
                    r"'layers_0', 'layers_2'.*nn.Sequential is named layers_<i>") as record:
    params = model.init(jax.random.key(0), x)
  assert not any("layers_0'" in str(w.message).split("paths")[0] for w in record), "a matching entry is not named"
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # once per converted model: its later calls stay quiet
    model.apply(params, x)
    jaxlowbit.convert(Model(), Int8MixedPrecision(), filter_fqns=("lm_head", "block_1.up")).init(
        jax.random.key(0), x)  # every entry matches
  with pytest.warns(UserWarning, match=r"conversion_report: filter_fqns entry 'lm_head' matches no Dense layer"):
    report = jaxlowbit.conversion_report(model, x)
  assert [layer.path for layer in report.converted] == ["layers_2"]
