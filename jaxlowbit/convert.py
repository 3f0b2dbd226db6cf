"""``convert``: run an existing Linen model's Dense/DenseGeneral layers quantized.

The user's code is not rewritten. ``convert`` returns an instance of a subclass of the
model's own class whose public methods run under ``flax.linen.intercept_methods``; the
interceptor takes over ``__call__`` of every ``nn.Dense`` / ``nn.DenseGeneral`` inside and
runs its body with the recipe's matmul (:func:`jaxlowbit.layers.dense_general`). The
parameter tree is unchanged, so checkpoints move freely between the original and the
converted model, and the converted model is still an instance of the original class.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import flax.linen as nn

from jaxlowbit.layers import _LowBitDenseGeneral, dense_general
from jaxlowbit.recipes import Float8, Recipe, check_recipe

# Layers whose K (in features) or N (out features) are small gain nothing from low-bit
# GEMMs: quantization passes cost more than the faster matmul saves. Starting points are
# torchao's float8 auto-filters measured on H100 (torchao names them by the *weight's*
# shape (out, in); here K is in and N is out). Rowwise-scaled recipes (INT8 row/column,
# FP8 rowwise, BitNet per-token) pay for axis-wise scale passes: skip when K <= 2048, or
# N <= 1024, or (K <= 4096 and N <= 2048). Tensorwise FP8 is cheaper: skip when
# N <= 4096 and K <= 1024. Every low-bit GEMM also wants K and N multiples of 16.
# TODO(benchmarks/layer.py): refine from our own layer benchmark on the GPU runner.
TENSOR_CORE_MULTIPLE = 16
ROWWISE_MIN_K = 2048
ROWWISE_MIN_N = 1024
ROWWISE_MIN_K_FOR_SMALL_N = 4096
ROWWISE_SMALL_N = 2048
TENSORWISE_SMALL_K = 1024
TENSORWISE_SMALL_N = 4096


def worth_quantizing(k: int, n: int, recipe: Recipe) -> bool:
  """Whether a ``[K, N]`` linear is large enough for ``recipe`` to speed it up (see above)."""
  if k % TENSOR_CORE_MULTIPLE or n % TENSOR_CORE_MULTIPLE:
    return False
  if isinstance(recipe, Float8) and not recipe.rowwise:
    return not (k <= TENSORWISE_SMALL_K and n <= TENSORWISE_SMALL_N)
  if k <= ROWWISE_MIN_K or n <= ROWWISE_MIN_N:
    return False
  return not (k <= ROWWISE_MIN_K_FOR_SMALL_N and n <= ROWWISE_SMALL_N)


def _linear_kn(module: nn.Module, inputs) -> tuple[int, int]:
  axis = getattr(module, "axis", -1)
  axis = (axis,) if isinstance(axis, int) else tuple(axis)
  features = module.features
  features = (features,) if isinstance(features, int) else tuple(features)
  return math.prod(inputs.shape[a] for a in axis), math.prod(features)


def module_fqn(module: nn.Module) -> str:
  """Dot-joined path of a bound module, e.g. ``"decoder.layers_0.mlp.wi"``."""
  return ".".join(str(p) for p in module.path)


def _interceptor(recipe: Recipe, filter_fqns: Sequence[str], auto_filter_small_kn: bool):
  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if (
        context.method_name != "__call__"
        or not isinstance(module, (nn.Dense, nn.DenseGeneral))
        or isinstance(module, _LowBitDenseGeneral)  # already low-bit: its recipe wins
        or module.dot_general is not None  # the user chose their own dot: leave it alone
        or module.dot_general_cls is not None
    ):
      return next_fun(*args, **kwargs)
    fqn = module_fqn(module)
    if any(f in fqn for f in filter_fqns):
      return next_fun(*args, **kwargs)
    inputs = args[0] if args else kwargs["inputs"]
    if auto_filter_small_kn and not worth_quantizing(*_linear_kn(module, inputs), recipe):
      return next_fun(*args, **kwargs)
    return dense_general(module, inputs, recipe)

  return intercept


def intercepted_copy(module: nn.Module, interceptor: Callable, who: str, **class_attrs) -> nn.Module:
  """A copy of unbound ``module`` whose public methods run under ``nn.intercept_methods(interceptor)``.

  The copy is an instance of a subclass of ``type(module)`` (same name, same fields, same
  parameter tree); ``class_attrs`` become attributes of that subclass. Shared by
  :func:`convert` and ``jaxlowbit.inference.convert_for_inference``.
  """
  if module.scope is not None:
    raise ValueError(
        f"{who}: got a module already bound to a parent (built inside a compact method); convert the "
        f"model definition outside (model = {who}(Model(...), ...)) and pass it in as an attribute"
    )
  cls = type(module)

  def wrap(method: Callable) -> Callable:
    def run_intercepted(self, *args, **kwargs):
      with nn.intercept_methods(interceptor):
        return method(self, *args, **kwargs)

    # Copy name and doc only: copying __dict__ would mark the wrapper @compact too.
    return functools.update_wrapper(run_intercepted, method, updated=())

  namespace = {name: wrap(getattr(cls, name)) for name in _public_methods(cls)}
  namespace.update(class_attrs, __module__=cls.__module__)
  converted_cls = type(cls.__name__, (cls,), namespace)
  fields = {f.name: getattr(module, f.name) for f in dataclasses.fields(module) if f.init and f.name != "parent"}
  return converted_cls(**fields)


def _public_methods(cls: type) -> list[str]:
  names = []
  for klass in cls.__mro__:
    if klass in (nn.Module, object):
      break
    for name, value in vars(klass).items():
      public = name == "__call__" or not name.startswith("_")
      if public and name != "setup" and callable(value) and not isinstance(value, type) and name not in names:
        names.append(name)
  return names


def convert(
    module: nn.Module,
    recipe: Recipe,
    filter_fqns: Sequence[str] = (),
    auto_filter_small_kn: bool = False,
) -> nn.Module:
  """A copy of ``module`` whose ``nn.Dense``/``nn.DenseGeneral`` layers run with ``recipe``.

  Args:
    module: an unbound Linen module (usually the whole model).
    recipe: :class:`Int8MixedPrecision`, :class:`Float8` or :class:`BitNet`.
    filter_fqns: layers whose dot-joined path (``module_fqn``, e.g. ``"lm_head"`` or
      ``"layers_0.attn"``) contains any of these strings stay high precision.
    auto_filter_small_kn: also leave layers too small to gain in high precision
      (:func:`worth_quantizing`).

  Returns:
    An instance of a subclass of ``type(module)`` with the same attributes and the same
    parameter tree. Layers that set their own ``dot_general``, and jaxlowbit layers, are
    left as they are. BitNet's RMSNorm before each linear is *not* inserted: that model
    surgery stays explicit in the model's code.
  """
  if not isinstance(module, nn.Module):
    raise TypeError(f"convert: expected a flax.linen Module, got {type(module).__name__}")
  check_recipe(recipe, "convert")
  if recipe is None:
    raise TypeError("convert: recipe must be Int8MixedPrecision, Float8 or BitNet (None converts nothing)")
  if isinstance(filter_fqns, str):
    raise TypeError("convert: filter_fqns must be a sequence of strings, e.g. ('lm_head',), not a string")
  return intercepted_copy(
      module, _interceptor(recipe, tuple(filter_fqns), auto_filter_small_kn), "convert", jaxlowbit_recipe=recipe
  )

__all__ = ["convert", "intercepted_copy", "module_fqn", "worth_quantizing"]
