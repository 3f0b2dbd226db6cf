"""``convert``: run an existing Linen model's Dense/DenseGeneral layers quantized.

The user's code is not rewritten. ``convert`` returns an instance of a subclass of the
model's own class that runs under a Linen method interceptor (``jaxlowbit.interception``):
every ``nn.Dense`` / ``nn.DenseGeneral`` inside computes its body with the recipe's matmul
(:func:`jaxlowbit.layers.dense_general`). The parameter tree is unchanged, so checkpoints move
freely between the original and the converted model, and the converted model is still an
instance of the original class. ``apply`` and ``init`` intercept whatever they run, so
``method=`` (the original class's method, a submodule's) runs converted too.

:func:`conversion_report` traces a converted model once (no compute) and says, layer by layer,
what runs with which recipe and why a layer stayed high precision.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax

from jaxlowbit.execution import ExecutionOptions
from jaxlowbit.interception import PASS, LayerFilter, as_filter, dense_interceptor, intercepted_copy, module_path
from jaxlowbit.layers import LowBitDense, dense_general, recipe_matmul, resolve
from jaxlowbit.recipes import Recipe, check_recipe


def worth_quantizing(k: int, n: int, recipe: Recipe) -> bool:
  """Whether a ``[K, N]`` linear is large enough for ``recipe`` to speed it up (``Recipe.worth_quantizing``)."""
  check_recipe(recipe, "worth_quantizing")
  return recipe.worth_quantizing(k, n)


def module_fqn(module: nn.Module) -> str:
  """Dot-joined path of a bound module, e.g. ``"decoder.layers_0.mlp.wi"``."""
  return module_path(module)


@dataclasses.dataclass(frozen=True)
class ConvertedLayer:
  """One Dense layer of a converted model: its path, ``[K, N]``, and its recipe or why it has none."""

  path: str
  k: int
  n: int
  recipe: Recipe | None
  reason: str = ""  # why it stayed high precision (empty when it runs ``recipe``)


@dataclasses.dataclass(frozen=True)
class ConversionReport:
  """What :func:`convert` did to a model, layer by layer (``str()`` gives a table)."""

  layers: tuple[ConvertedLayer, ...]

  @property
  def converted(self) -> tuple[ConvertedLayer, ...]:
    return tuple(layer for layer in self.layers if layer.recipe is not None)

  def __str__(self) -> str:
    rows = [("path", "K", "N", "recipe / kept because")]
    rows += [(layer.path or "(root)", str(layer.k), str(layer.n), str(layer.recipe) if layer.recipe else layer.reason)
             for layer in self.layers]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join([c.ljust(w) for c, w in zip(r[:3], widths)] + [r[3]]) for r in rows]
    return "\n".join(lines + [f"{len(self.converted)} of {len(self.layers)} Dense layers converted"])


@dataclasses.dataclass(frozen=True)
class _Rules:
  recipe: Recipe
  layer_filter: LayerFilter
  auto_filter_small_kn: bool
  execution: ExecutionOptions | None = None

  def decide(self, module: nn.Module, inputs, path: str) -> ConvertedLayer:
    """What this layer runs (the one rule shared by the interceptor and the report)."""
    k, n = resolve(module, inputs).kn
    if isinstance(module, LowBitDense):
      return ConvertedLayer(path, k, n, None, f"a jaxlowbit layer: runs its own recipe {module.recipe}")
    if self.layer_filter.keeps(path, module):
      return ConvertedLayer(path, k, n, None, "filtered (filter_fqns / filter_fn)")
    if self.auto_filter_small_kn and not self.recipe.worth_quantizing(k, n):
      return ConvertedLayer(path, k, n, None, "too small to gain (auto_filter_small_kn)")
    return ConvertedLayer(path, k, n, self.recipe)


def _handler(rules: _Rules, record: Callable[[ConvertedLayer], None] | None = None):
  def handle(module, inputs, path):
    layer = rules.decide(module, inputs, path)
    if record is not None:
      record(layer)
    return PASS if layer.recipe is None else dense_general(module, inputs, recipe_matmul(layer.recipe, rules.execution))

  return handle


def _warn_unmatched(fqns: Sequence[str], paths: Sequence[str], model: str, who: str) -> None:
  """Warn about every ``filter_fqns`` entry that is part of none of the Dense layer ``paths`` seen."""
  unmatched = [f for f in fqns if not any(f in path for path in paths)]
  if unmatched and paths:
    shown = ", ".join(repr(p) for p in list(dict.fromkeys(paths))[:8]) + (", ..." if len(set(paths)) > 8 else "")
    warnings.warn(
        f"{who}: filter_fqns entr{'y' if len(unmatched) == 1 else 'ies'} {', '.join(map(repr, unmatched))} "
        f"match{'es' if len(unmatched) == 1 else ''} no Dense layer of {model}, so nothing is kept in high "
        f"precision for {'it' if len(unmatched) == 1 else 'them'}; the Dense layers' paths are {shown} "
        "(a layer in nn.Sequential is named layers_<i>; name it, or filter on its path)",
        stacklevel=3,
    )


class _FilterCheck:
  """Collects the Dense paths of a converted model's first call and then warns once about
  ``filter_fqns`` entries that matched none (entered around every intercepted call: the
  outermost one ends the call)."""

  def __init__(self, fqns: tuple[str, ...], model: str):
    self.fqns, self.model = fqns, model
    self.paths: list[str] = []
    self.depth = 0
    self.done = not fqns

  def see(self, layer: ConvertedLayer) -> None:
    if not self.done:
      self.paths.append(layer.path)

  @contextlib.contextmanager
  def __call__(self):
    self.depth += 1
    try:
      yield
    finally:
      self.depth -= 1
      if self.depth == 0 and not self.done and self.paths:
        self.done = True
        _warn_unmatched(self.fqns, self.paths, self.model, "convert")


def convert(
    module: nn.Module,
    recipe: Recipe,
    filter_fqns: Sequence[str] = (),
    auto_filter_small_kn: bool = False,
    filter_fn: Callable[[str, nn.Module], bool] | None = None,
    execution: ExecutionOptions | None = None,
) -> nn.Module:
  """A copy of ``module`` whose ``nn.Dense``/``nn.DenseGeneral`` layers run with ``recipe``.

  Args:
    module: an unbound Linen module (usually the whole model).
    recipe: :class:`Int8MixedPrecision`, :class:`Float8` or :class:`BitNet`.
    filter_fqns: layers whose dot-joined path (e.g. ``"lm_head"`` or ``"layers_0.attn"``)
      contains any of these strings stay high precision ("" is an error: it is in every path).
      The first call of the converted model warns about an entry that matches no Dense layer
      (a layer inside ``nn.Sequential`` is named ``layers_<i>``, not by its variable name).
    auto_filter_small_kn: also leave layers too small to gain in high precision
      (``recipe.worth_quantizing``).
    filter_fn: ``filter_fn(path, module) -> bool``; True keeps that layer high precision.
    execution: how the converted layers' kernels run (:class:`jaxlowbit.ExecutionOptions`; None:
      the defaults, the backend from ``$JAXLOWBIT_BACKEND``).

  Returns:
    An instance of a subclass of ``type(module)`` with the same attributes and the same
    parameter tree. Layers that set their own ``dot_general`` (other than the high-precision
    one of ``dense_for(None)``), and jaxlowbit layers, are left as they are. BitNet's RMSNorm
    before each linear is *not* inserted: that model surgery stays explicit in the model's code.
    :func:`conversion_report` lists what it does.
  """
  if not isinstance(module, nn.Module):
    raise TypeError(f"convert: expected a flax.linen Module, got {type(module).__name__}")
  check_recipe(recipe, "convert")
  if recipe is None:
    raise TypeError("convert: recipe must be Int8MixedPrecision, Float8 or BitNet (None converts nothing)")
  rules = _Rules(recipe, as_filter(filter_fqns, filter_fn), auto_filter_small_kn, execution)
  check = _FilterCheck(rules.layer_filter.fqns, type(module).__name__)
  return intercepted_copy(module, dense_interceptor(_handler(rules, check.see)), "convert", context=check,
                          jaxlowbit_convert_rules=rules, jaxlowbit_recipe=recipe)


def conversion_report(model: nn.Module, *args, method=None, params=None, **kwargs) -> ConversionReport:
  """What a :func:`convert` ed ``model`` runs, layer by layer, for the call ``model.apply(..., *args)``.

  Traces the model once with ``jax.eval_shape`` (nothing is computed). Warns when no layer
  was converted and when a ``filter_fqns`` entry matches no Dense layer.

  Args:
    model: the result of :func:`convert`.
    *args, method, **kwargs: an example call, as for ``model.apply`` / ``model.init``
      (arrays or ``jax.ShapeDtypeStruct``).
    params: the ``"params"`` collection to apply (default: the model's own init).
  """
  rules = getattr(type(model), "jaxlowbit_convert_rules", None)
  if rules is None:
    raise TypeError(f"conversion_report: {type(model).__name__} is not a jaxlowbit.convert result")
  seen: dict[str, ConvertedLayer] = {}
  recording = dense_interceptor(_handler(rules, lambda layer: seen.setdefault(layer.path, layer)))

  def run(*a):
    with nn.intercept_methods(recording):
      if params is None:
        return model.init(jax.random.key(0), *a, method=method, **kwargs)
      return model.apply({"params": params}, *a, method=method, **kwargs)

  jax.eval_shape(run, *args)
  report = ConversionReport(tuple(seen.values()))
  _warn_unmatched(rules.layer_filter.fqns, list(seen), type(model).__name__, "conversion_report")
  if not report.converted:
    warnings.warn(f"convert: no Dense layer of {type(model).__name__} runs {rules.recipe} "
                  f"({len(report.layers)} found; see the report's reasons)", stacklevel=2)
  return report


__all__ = ["ConversionReport", "ConvertedLayer", "conversion_report", "convert", "module_fqn", "worth_quantizing"]
