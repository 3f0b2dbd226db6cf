"""``ExecutionOptions``: how jaxlowbit runs a model's quantized ops, passed explicitly.

Which kernels run, whether producers quantize on the way, and which tensor-parallel axis a model
runs over are options of the *run*, not of the numerics (the recipe) and not global state. They
travel as one frozen value, the way Flax and Pallas pass configuration:

=====================  ========================================================================
field                  what reads it
=====================  ========================================================================
``backend``            ``pallas_kernels.dispatch`` (``auto`` / ``xla`` / ``pallas``; None: the
                       environment's, below)
``fused_quantizers``   ``jaxlowbit.fused``: an RMSNorm / SwiGLU quantizes its output for the
                       linear reading it (off in a model converted for inference)
``tensor_parallel``    the model (``train/model.py``): this device's tokens, the gathers before
                       column-parallel groups; ``jaxlowbit.parallel.apply`` sets it
``decode_inputs``      ``jaxlowbit.fused``: the per-row spec in which a decode step's norm hands
                       its output, as codes, to a converted linear whose recipe quantizes its
                       input that way; ``jaxlowbit.inference.convert_for_inference`` sets it
                       (ternary; W8A8 where the policy says so)
``decode_input_rows``  ``jaxlowbit.fused``: the most rows at which it hands them
``gated_outputs``      the model (``train/model.py``): a decode step's gated MLP projection returns
                       ``act(gate) * up`` itself (``jaxlowbit.LowBitDense.gated``), which the
                       converted linear's GEMV forms in its epilogue; ``convert_for_inference``
                       sets it (ternary, W8A16)
=====================  ========================================================================

Who passes it: ``quantized_matmul(..., options=)``, the Dense layers' ``execution`` field
(``jaxlowbit.LowBitDense``), the producers' ``options=`` argument, and a model's ``execution``
field. ``jaxlowbit.parallel.apply`` and ``jaxlowbit.inference.convert_for_inference`` run a model
that declares an ``execution`` field as ``model.clone(execution=...)`` with their change made, so
the model hands it on to its layers and producers.

The environment: ``backend=None`` (the default) means "as ``$JAXLOWBIT_BACKEND`` says". It is
resolved at the library's edge, once per call that enters it (:meth:`ExecutionOptions.resolved`,
``pallas_kernels.policy.requested_backend``, the only reader of the variable); below that edge
every function gets a concrete backend as an argument. So ``JAXLOWBIT_BACKEND=xla python ...``
keeps working, and two options in one process or one trace give two behaviours.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxlowbit_numerics.formats import QuantSpec
from jaxlowbit_numerics.stats import NO_SPLIT, Split
from pallas_kernels import policy
from pallas_kernels.dispatch import DispatchOptions


@dataclasses.dataclass(frozen=True)
class ExecutionOptions:
  """How jaxlowbit runs (module docstring); frozen and hashable: a Flax field, a static argument.

  Attributes:
    backend: ``"auto"``, ``"xla"`` or ``"pallas"`` (``pallas_kernels.policy.BACKENDS``); None:
      ``$JAXLOWBIT_BACKEND`` (``auto`` when unset), read where the options are resolved.
    fused_quantizers: producers (``jaxlowbit.fused``) may hand a linear its input quantized.
    tensor_parallel: the :class:`jaxlowbit.parallel.TensorParallel` a model runs over inside
      ``shard_map`` (set by ``jaxlowbit.parallel.apply``), or None.
    decode_inputs: the per-row int8 ``QuantSpec`` in which a model's converted linears take their input from a
      decode step's norm (``jaxlowbit.fused.decode_quantization``), or None (they take it in high precision).
    decode_input_rows: the most rows (tokens) at which a decode step's norm hands them its codes, or None (every
      row count its kernel takes); beyond it the linears quantize the norm's output themselves.
    gated_outputs: a decode step's fused gate_up projection returns the gated activation ``act(gate) * up``
      instead of ``[gate | up]`` (``jaxlowbit.LowBitDense.gated``): set for a model converted for a scheme whose
      decode GEMV forms it in its epilogue (``jaxlowbit.inference.weights.gated_outputs``).

  Example::

    layer = jaxlowbit.Int8Dense(features=4096, execution=ExecutionOptions(backend="xla"))
    y = jaxlowbit.quantized_matmul(x, w, recipe, options=ExecutionOptions(backend="pallas"))
  """

  backend: str | None = None
  fused_quantizers: bool = True
  tensor_parallel: Any = None
  decode_inputs: QuantSpec | None = None
  decode_input_rows: int | None = None
  gated_outputs: bool = False

  def __post_init__(self):
    if self.backend is not None:
      policy.check_backend(self.backend)
    for name in ("fused_quantizers", "gated_outputs"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(f"ExecutionOptions.{name} must be a bool, got {getattr(self, name)!r}")
    if self.decode_inputs is not None and not isinstance(self.decode_inputs, QuantSpec):
      raise TypeError(f"ExecutionOptions.decode_inputs must be a QuantSpec or None, got {self.decode_inputs!r}")
    rows = self.decode_input_rows
    if rows is not None and (not isinstance(rows, int) or isinstance(rows, bool) or rows < 0):
      raise ValueError(f"ExecutionOptions.decode_input_rows must be an integer >= 0 or None, got {rows!r}")

  def resolved(self) -> ExecutionOptions:
    """These options with the backend filled in from the environment where it is None."""
    if self.backend is not None:
      return self
    return dataclasses.replace(self, backend=policy.requested_backend())

  def dispatch(self, split: Split | None = None) -> DispatchOptions:
    """The kernels' options: this backend (resolved) and how the operand is split (None: local)."""
    return DispatchOptions(self.resolved().backend, split or NO_SPLIT)

  def replace(self, **changes) -> ExecutionOptions:
    return dataclasses.replace(self, **changes)


DEFAULT = ExecutionOptions()
# The field through which a model (or layer) takes its options; the library's runners set it.
EXECUTION_FIELD = "execution"


def with_execution(module, **changes):
  """``module.clone(execution=...)`` with ``changes`` made to its ``execution`` options, for a Flax module
  that declares an ``execution`` field (module docstring); any other module comes back as it is."""
  if not any(field.name == EXECUTION_FIELD for field in dataclasses.fields(module)):
    return module
  current = getattr(module, EXECUTION_FIELD) or DEFAULT
  return module.clone(**{EXECUTION_FIELD: current.replace(**changes)})


def resolve(options: ExecutionOptions | None) -> ExecutionOptions:
  """``options`` with the environment's backend filled in (None: the defaults): the library's edge."""
  if options is not None and not isinstance(options, ExecutionOptions):
    raise TypeError(f"options must be a jaxlowbit.ExecutionOptions or None, got {options!r}")
  return (options or DEFAULT).resolved()


__all__ = ["DEFAULT", "EXECUTION_FIELD", "ExecutionOptions", "resolve", "with_execution"]
