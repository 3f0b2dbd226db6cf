"""Taking over a Linen model's Dense layers: the one interceptor and the one filter rule.

Every way jaxlowbit changes how an existing Flax model's linears compute goes through here:
``jaxlowbit.convert`` (a recipe), ``jaxlowbit.parallel`` (record the linears, then run them on
gathered weight shards), ``jaxlowbit.inference`` (converted weights; calibration). Each plugs a
*handler* into :func:`dense_interceptor`; the interceptor owns what they share:

- what a Dense is (:func:`is_dense`): ``nn.Dense`` / ``nn.DenseGeneral`` and their subclasses
  (jaxlowbit's layers included) that do not bring their own ``dot_general`` (jaxlowbit's
  high-precision one, which ``dense_for(None)`` sets, counts as none);
- the input (:func:`call_inputs`) and the module's dot-joined path (:func:`module_path`,
  e.g. ``"layers_0.mlp.down"``);
- which layers stay high precision (:class:`LayerFilter`: path substrings and/or a predicate).

The layer's computation itself is ``jaxlowbit.layers.dense_general``, the one Dense body,
with the handler's matmul.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn

from jaxlowbit.matmul import is_high_precision_dot_general

# A handler returns this to let the layer run as it is.
PASS = object()

# handler(module, inputs, path) -> output or PASS
Handler = Callable[[nn.Module, Any, str], Any]


def is_dense(module: nn.Module) -> bool:
  """Whether ``module`` is a Dense-family layer whose dot jaxlowbit may run."""
  return (
      isinstance(module, (nn.Dense, nn.DenseGeneral))
      and (getattr(module, "dot_general", None) is None or is_high_precision_dot_general(module.dot_general))
      and getattr(module, "dot_general_cls", None) is None
  )


def module_path(module: nn.Module) -> str:
  """Dot-joined path of a bound module, e.g. ``"decoder.layers_0.mlp.wi"``."""
  return ".".join(str(p) for p in module.path)


def call_inputs(args: tuple, kwargs: dict):
  """The ``inputs`` argument of a Dense ``__call__``."""
  return args[0] if args else kwargs["inputs"]


@dataclasses.dataclass(frozen=True)
class LayerFilter:
  """Which layers stay high precision: the one rule of convert, FSDP, inference and the trainer.

  Attributes:
    fqns: a layer whose dot-joined path contains any of these strings is kept (e.g.
      ``("lm_head",)``, ``("layers_0.attn",)``). An empty string would match every layer and is
      an error; so is a bare string instead of a sequence.
    fn: optional ``fn(path, module) -> bool``; True keeps that layer too.
  """

  fqns: tuple[str, ...] = ()
  fn: Callable[[str, nn.Module], bool] | None = None

  def __post_init__(self):
    if isinstance(self.fqns, str):
      raise TypeError(f"filter_fqns must be a sequence of strings, e.g. ('lm_head',), not a string ({self.fqns!r})")
    fqns = tuple(self.fqns)
    for f in fqns:
      if not isinstance(f, str):
        raise TypeError(f"filter_fqns must hold strings, got {f!r} ({type(f).__name__})")
      if not f:
        raise ValueError("filter_fqns holds an empty string, which is part of every path and would keep every layer "
                         "in high precision; remove it (or pass no filter)")
    if self.fn is not None and not callable(self.fn):
      raise TypeError(f"filter_fn must be callable as filter_fn(path, module), got {self.fn!r}")
    object.__setattr__(self, "fqns", fqns)

  def keeps(self, path: str, module: nn.Module | None = None) -> bool:
    """Whether the layer at ``path`` stays high precision."""
    if any(f in path for f in self.fqns):
      return True
    return self.fn is not None and bool(self.fn(path, module))


def dense_interceptor(handler: Handler) -> Callable:
  """A ``flax.linen.intercept_methods`` interceptor that hands every Dense ``__call__`` to ``handler``."""

  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name != "__call__" or not is_dense(module):
      return next_fun(*args, **kwargs)
    out = handler(module, call_inputs(args, kwargs), module_path(module))
    return next_fun(*args, **kwargs) if out is PASS else out

  return intercept


def intercepted_copy(module: nn.Module, interceptor: Callable, who: str, context: Callable | None = None,
                     **class_attrs) -> nn.Module:
  """A copy of unbound ``module`` that runs under ``nn.intercept_methods(interceptor)``.

  The copy is an instance of a subclass of ``type(module)`` (same name, same fields, same
  parameter tree); ``class_attrs`` become attributes of that subclass; ``context()``, when given,
  is entered around every intercepted call too. Its public methods run
  intercepted when the model is used as a submodule, and ``apply`` / ``init`` /
  ``init_with_output`` intercept whatever they run, so ``method=`` (the original class's
  method, a submodule's, a function) is intercepted too.
  """
  if module.scope is not None:
    raise ValueError(
        f"{who}: got a module already bound to a parent (built inside a compact method); convert the "
        f"model definition outside (model = {who}(Model(...), ...)) and pass it in as an attribute"
    )
  cls = type(module)

  def wrap(method: Callable) -> Callable:
    def run_intercepted(self, *args, **kwargs):
      with nn.intercept_methods(interceptor), (context() if context else contextlib.nullcontext()):
        return method(self, *args, **kwargs)

    # Copy name and doc, and the @compact mark (a Dense intercepted at the top creates its bias):
    # copying all of __dict__ would copy flax's wrapping state too.
    wrapper = functools.update_wrapper(run_intercepted, method, updated=())
    if getattr(method, "compact", False):
      wrapper.compact = True
    return wrapper

  namespace = {name: wrap(getattr(cls, name)) for name in _public_methods(cls)}
  for entry in ("apply", "init", "init_with_output"):
    namespace[entry] = wrap(getattr(nn.Module, entry))
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


def as_filter(filter_fqns: Sequence[str] | LayerFilter = (), filter_fn=None) -> LayerFilter:
  """A :class:`LayerFilter` from the ``filter_fqns`` / ``filter_fn`` arguments of the public functions."""
  if isinstance(filter_fqns, LayerFilter):
    return filter_fqns if filter_fn is None else dataclasses.replace(filter_fqns, fn=filter_fn)
  return LayerFilter(filter_fqns, filter_fn)


__all__ = [
    "PASS",
    "LayerFilter",
    "as_filter",
    "call_inputs",
    "dense_interceptor",
    "intercepted_copy",
    "is_dense",
    "module_path",
]
