"""Reductions of one block in one pass (Pallas, Triton backend): ``sum(a)`` and ``max(b)`` of some ``b`` along an axis.

Pallas lowers each ``jnp.sum`` and ``jnp.max`` to a Triton reduction of its own. On a GPU that is a tree of warp
shuffles, then an exchange between the warps through shared memory behind a barrier, so two statistics of one row
cost two such trees, one after the other. :func:`sum_and_max` lowers them all to one ``tt.reduce`` of several
operands: their shuffles interleave and the warps meet once. Each result is what the single reduction gives (the same
combining order, applied to a pair).

The lowering reuses Pallas's own (``jax._src.pallas.triton.lowering``, a private module). Where that is missing (a
jax that moved it), :data:`FUSED` is False and :func:`sum_and_max` is the two reductions; in interpret mode (CPU
tests) it is always the two reductions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive

_sum_max_p = Primitive("jaxlowbit_sum_max")
_sum_max_p.multiple_results = True


def _reduced(aval, axis: int):
  return aval.update(shape=aval.shape[:axis] + aval.shape[axis + 1:])


_sum_max_p.def_abstract_eval(lambda *avals, axis: [_reduced(aval, axis) for aval in avals])


def _combine(left, right):
  return left[0] + right[0], *(jnp.maximum(a, b) for a, b in zip(left[1:], right[1:]))


def _register() -> bool:
  try:
    from jax._src.pallas.triton import lowering
    reduction, rules = lowering._reduction_lowering, lowering.triton_lowering_rules
  except (ImportError, AttributeError):
    return False

  def rule(ctx, *operands, axis):
    return reduction(_combine, ctx, operands, axes=(axis,))

  rules[_sum_max_p] = rule
  return True


# Whether the one-pass lowering is installed (False: sum_and_max is two reductions everywhere).
FUSED = _register()


def sum_and_max(a: jax.Array, bs: tuple[jax.Array, ...], axis: int, native: bool
                ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """``(jnp.sum(a, axis), tuple(jnp.max(b, axis) for b in bs))`` inside a Pallas Triton kernel, as one reduction on
  a GPU (``native`` and :data:`FUSED`). ``a`` and every ``b``: one shape, float32. NaN gets no handling beyond
  ``jnp.maximum``'s: map it first where it must count (``quantize.magnitude``)."""
  if any(b.shape != a.shape for b in bs):
    raise ValueError(f"sum_and_max: a {a.shape} and bs {[b.shape for b in bs]} differ in shape")
  if native and FUSED:
    total, *tops = _sum_max_p.bind(a, *bs, axis=axis)
    return total, tuple(tops)
  return jnp.sum(a, axis=axis), tuple(jnp.max(b, axis=axis) for b in bs)
