"""Fused low-bit Adam update (Pallas, Triton backend): one pass over a tensor's gradient and states.

``jaxlowbit.optim.scale_by_adam_quantized`` keeps ``m`` and ``v`` block-wise quantized
(:mod:`jaxlowbit_numerics.blockwise`: codes ``[*lead, N]`` or, 4-bit, ``[*lead, N / 2]``, float32
block scales ``[*lead, N / B]``). Its XLA update (:func:`adam_update_reference`, the spec) decodes
both moments, runs the Adam arithmetic, and re-encodes with one max per block; XLA's fusion
choices decide its cost (on an H200 the 8-bit update took 2x ``optax.adamw``'s step: update,
block max and encode landed in one slow multi-output reduction fusion).

The kernel reads, per element, the gradient (4 bytes in float32) and the codes of ``m`` and
``v`` (two bytes at 8 bits, one at 4), per block the two scales, and writes the new codes and
scales and the float32 update ``u`` (4 bytes): about 12 bytes per parameter at 8 bits.
``add_decayed_weights``, ``scale_by_learning_rate`` and ``apply_updates`` then run in XLA as one
elementwise pass (read ``u`` and ``p``, write ``p``: 12 bytes for float32 parameters), about 24
in all against the ~28 of ``optax.adamw``'s step (read g, m, v, p; write m, v, p).

:func:`adam_step_kernel` (``jaxlowbit.optim.apply_step``'s fused step) is the same program that
also reads ``p`` and writes ``p + neg_lr (u + wd p)`` in its place
(``jaxlowbit_numerics.adam.apply_update``; bf16 parameters optionally rounded stochastically with
``jaxlowbit_numerics.random.hash_bits`` of the element's flat index and a seed): 16 bytes per
float32 parameter at 8 bits, and ``u`` never reaches memory.

Each program owns ``rows`` consecutive blocks (the tensor viewed as ``[N_blocks, B]``, which is
free for a last axis that is a multiple of ``B``). Every value is computed with the functions
XLA's update uses: ``blockwise.decode_values`` / ``encode_values`` / ``block_scales`` for the
codes, ``adam.adam_moments`` for the arithmetic. Here a dynamic map decodes by gathering its
table entry (``blockwise.decode`` given the table; XLA computes the value): the tables sit in the
kernel's float32 constants operand after the step's coefficients (:func:`constants`), so a code
costs one cached load instead of the dozens of compares and selects that compute its value.
Packed 4-bit codes are read as whole bytes; their two nibbles belong to a block's even and odd
elements, which the kernel loads and stores with stride 2 (``blockwise.pack_nibbles`` puts them
back together).

Numerics: the same codes as the reference except at exact ties of the nearest-code search (a
value within float rounding of the midpoint of two codes: Triton and XLA may contract
``a * b + c`` into an FMA differently, and XLA computes a dynamic map's values to 3e-7 of the table
the kernel gathers from, either of which moves a moment by an ulp or two), the same scales up to
that rounding, and ``u`` to a few float32 ulps (division and square root). A NaN or inf
gradient element turns its block's scales NaN, as in the reference; a finite one whose square
overflows has its element's moments scaled down by ``adam.fit_moments`` before they are stored, as
in the reference.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.experimental.pallas import triton as plt
from jax.sharding import NamedSharding, PartitionSpec

from jaxlowbit_numerics import stats
from jaxlowbit_numerics.adam import (
    COEFFICIENT_NAMES,
    AdamCoefficients,
    adam_moments,
    apply_update,
    coefficient_vector,
    fit_moments,
)
from jaxlowbit_numerics.blockwise import (
    BlockFormat,
    BlockQuantized,
    block_scales,
    code_table,
    decode_values,
    dequantize_blockwise,
    encode_values,
    pack_nibbles,
    quantize_blockwise,
    stored_shapes,
    unpack_nibbles,
)
from jaxlowbit_numerics.random import flat_index_bits, hash_bits
from pallas_kernels.vma import out_struct

# Block sizes the kernel takes: Triton tiles are powers of two, and a 4-bit block's half
# (its even or odd elements) must still fill a 16-element vector.
MIN_BLOCK, MAX_BLOCK = 32, 8192
# Moment kinds the kernel was checked with on a GPU (tests/test_optim_gpu.py). e5m2 and square-root
# storage (BlockFormat.sqrt) were measured on CPU only and no optimizer ships them: XLA's update.
KERNEL_KINDS = frozenset({"dynamic", "linear", "e4m3", "fp16"})
GRADIENT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Parameters the fused step writes (adam_step_kernel): float32 masters, or bf16 weights.
PARAM_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class AdamKernelConfig:
  """Launch configuration (``pallas_kernels.tuning.adam_config`` picks one).

  Attributes:
    elements: elements per program (a power of two; ``elements / B`` blocks, fewer when the
      tensor's block count is not a multiple of that).
    num_warps: warps per program.
  """

  elements: int = 4096
  num_warps: int = 4

  def __post_init__(self):
    if self.elements < 1 or self.elements & (self.elements - 1):
      raise ValueError(f"AdamKernelConfig: elements must be a power of two, got {self.elements}")


def _parts(m_format: BlockFormat, v_format: BlockFormat) -> tuple[tuple[int, int], ...]:
  """``(start, stride)`` of the slices of a block the kernel holds: the whole block, or, when a
  moment packs two 4-bit codes per byte, its even and its odd elements (a byte's two nibbles)."""
  if 4 in (m_format.storage_bits, v_format.storage_bits):
    return ((0, 2), (1, 2))
  return ((0, 1),)


class _TableView(NamedTuple):
  """A map's code table inside the kernel's constants operand: ``view[codes]`` gathers
  ``constants[offset + codes]`` (Triton takes one indexer per load, so no ``ref.at[...]``)."""

  ref: Any
  offset: int

  def __getitem__(self, codes: jax.Array) -> jax.Array:
    return self.ref[codes + self.offset]


def _table_offsets(m_format: BlockFormat, v_format: BlockFormat) -> tuple[int | None, int | None]:
  """Where the constants operand holds each moment's code table (None: not a dynamic map): after
  the step's coefficients, m's table then v's."""
  offset, offsets = len(COEFFICIENT_NAMES), []
  for fmt in (m_format, v_format):
    offsets.append(offset if fmt.kind == "dynamic" else None)
    offset += 2**fmt.bits if fmt.kind == "dynamic" else 0
  return offsets[0], offsets[1]


def constants(coefficients: AdamCoefficients, m_format: BlockFormat, v_format: BlockFormat) -> jax.Array:
  """The kernel's float32 constants operand: the step's coefficients, then the code tables the
  kernel gathers decoded values from (:func:`_table_offsets`)."""
  tables = [jnp.asarray(code_table(fmt)) for fmt in (m_format, v_format) if fmt.kind == "dynamic"]
  return jnp.concatenate([coefficient_vector(coefficients), *tables])


def _load_moment(codes_ref, scale_ref, rows, fmt: BlockFormat, parts, table) -> list[jax.Array]:
  """float32 values of one moment's blocks ``rows``, one ``[rows, B / len(parts)]`` array per part
  (``table``: its :class:`_TableView`, or None for formats decoded without one)."""
  scale = scale_ref[rows][:, None]
  size = fmt.block // len(parts)
  if fmt.storage_bits == 4:
    codes = unpack_nibbles(codes_ref[rows, :])  # (even elements, odd elements)
  else:
    codes = [codes_ref[rows, pl.ds(start, size, stride=stride)] for start, stride in parts]
  return [decode_values(c, scale, fmt, table) for c in codes]


def _store_moment(codes_ref, scale_ref, rows, values: list[jax.Array], fmt: BlockFormat, parts) -> None:
  """Quantize the blocks ``rows`` of one moment (``values`` per part) into its outputs."""
  amax = functools.reduce(jnp.maximum, [stats.absmax(x, axis=-1) for x in values])  # [rows, 1]
  inv, scale = block_scales(amax, fmt)
  codes = [encode_values(x, inv, fmt) for x in values]
  size = fmt.block // len(parts)
  if fmt.storage_bits == 4:
    codes_ref[rows, :] = pack_nibbles(*codes)
  else:
    for (start, stride), c in zip(parts, codes):
      codes_ref[rows, pl.ds(start, size, stride=stride)] = c
  scale_ref[rows] = scale[:, 0]


def _element_index(first_block, rows: int, block: int, start: int, stride: int, size: int) -> jax.Array:
  """uint32 ``[rows, size]`` flat indices (in the kernel's operand) of a part's elements."""
  row = jax.lax.broadcasted_iota(jnp.uint32, (rows, size), 0) + first_block.astype(jnp.uint32)
  col = jax.lax.broadcasted_iota(jnp.uint32, (rows, size), 1) * jnp.uint32(stride) + jnp.uint32(start)
  return row * jnp.uint32(block) + col


def _adam_kernel(g_ref, mc_ref, ms_ref, vc_ref, vs_ref, c_ref, *refs, m_format: BlockFormat, v_format: BlockFormat,
                 nesterov: bool, rows: int, param: bool, stochastic: bool):
  """One program: ``rows`` blocks. Without ``param``: ``refs = (u_out, codes and scales out)``; with
  it, ``refs = (p, step coefficients, p_out, codes and scales out)`` and the program also writes
  the parameter (:func:`jaxlowbit_numerics.adam.apply_update`)."""
  if param:
    p_ref, s_ref, out_ref, mc_out, ms_out, vc_out, vs_out = refs
  else:
    out_ref, mc_out, ms_out, vc_out, vs_out = refs
  first = pl.program_id(0) * rows
  blocks = pl.ds(first, rows)
  parts = _parts(m_format, v_format)
  size = m_format.block // len(parts)
  coefficients = AdamCoefficients(*(c_ref[k] for k in range(len(COEFFICIENT_NAMES))))
  m_table, v_table = (None if k is None else _TableView(c_ref, k) for k in _table_offsets(m_format, v_format))
  g = [g_ref[blocks, pl.ds(start, size, stride=stride)].astype(jnp.float32) for start, stride in parts]
  m = _load_moment(mc_ref, ms_ref, blocks, m_format, parts, m_table)
  v = _load_moment(vc_ref, vs_ref, blocks, v_format, parts, v_table)
  steps = [adam_moments(*gmv, coefficients, nesterov) for gmv in zip(g, m, v)]
  for (start, stride), (u, _, _) in zip(parts, steps):
    elements = (blocks, pl.ds(start, size, stride=stride))
    if param:
      bits = None
      if stochastic:
        seed = jax.lax.bitcast_convert_type(s_ref[2], jnp.uint32)
        bits = hash_bits(_element_index(first, rows, m_format.block, start, stride, size), seed)
      u = apply_update(p_ref[elements], u, s_ref[0], s_ref[1], bits)
    out_ref[elements] = u
  fitted = [fit_moments(*gmv, m_new, v_new, coefficients) for gmv, (_, m_new, v_new) in zip(zip(g, m, v), steps)]
  _store_moment(mc_out, ms_out, blocks, [f[0] for f in fitted], m_format, parts)
  _store_moment(vc_out, vs_out, blocks, [f[1] for f in fitted], v_format, parts)


def supported(g: jax.Array, m: BlockQuantized, v: BlockQuantized, m_format: BlockFormat, v_format: BlockFormat) -> bool:
  """Whether the kernel takes this tensor (else :func:`adam_update_reference` runs it).

  It needs moments of :data:`KERNEL_KINDS` without square-root storage, a shared power-of-two block
  in ``[MIN_BLOCK, MAX_BLOCK]``, a last axis that is a multiple of it (no short last block), a
  float32/bf16/fp16 gradient, and codes and scales of
  the shapes :func:`jaxlowbit_numerics.blockwise.stored_shapes` gives (under ``shard_map`` a
  device's scales may keep a dimension its codes split).
  """
  if any(fmt.kind not in KERNEL_KINDS or fmt.sqrt for fmt in (m_format, v_format)):
    return False
  block = m_format.block
  if v_format.block != block or block & (block - 1) or not MIN_BLOCK <= block <= MAX_BLOCK:
    return False
  if g.ndim < 1 or g.size == 0 or g.shape[-1] % block or jnp.dtype(g.dtype) not in GRADIENT_DTYPES:
    return False
  for q, fmt in ((m, m_format), (v, v_format)):
    codes_shape, scale_shape = stored_shapes(g.shape, fmt)
    if q.codes.shape != codes_shape or q.scale.shape != scale_shape or q.codes.dtype != fmt.code_dtype:
      return False
  return True


def _rows_per_program(n_blocks: int, block: int, config: AdamKernelConfig) -> int:
  """Blocks per program: ``config.elements / block``, halved until it divides ``n_blocks``."""
  rows = max(config.elements // block, 1)
  while n_blocks % rows:
    rows //= 2
  return rows


def step_vector(neg_lr, weight_decay, seed) -> jax.Array:
  """The fused step's scalars as one float32 ``[3]`` kernel operand: ``-learning_rate``, the
  parameter's weight decay, and the uint32 rounding ``seed`` (its bits, carried as a float32)."""
  seed = jax.lax.bitcast_convert_type(jnp.asarray(seed, jnp.uint32), jnp.float32)
  return jnp.stack([jnp.asarray(neg_lr, jnp.float32), jnp.asarray(weight_decay, jnp.float32), seed])


def _call(g, mc, ms, vc, vs, consts, *param, m_format: BlockFormat, v_format: BlockFormat, nesterov: bool,
          config: AdamKernelConfig, interpret: bool, stochastic: bool):
  """The ``pallas_call`` on one device's blocks: ``g [*b, B]``, codes ``[*b, B']``, scales ``[*b]``
  (``*b``: any leading shape, flattened here), ``consts`` the :func:`constants`; ``param``: empty,
  or ``(p [*b, B], step vector)`` to write the parameter instead of returning the update."""
  block = m_format.block
  n_blocks = ms.size
  rows = _rows_per_program(n_blocks, block, config)
  operands = (g.reshape(n_blocks, -1), mc.reshape(n_blocks, -1), ms.reshape(n_blocks), vc.reshape(n_blocks, -1),
              vs.reshape(n_blocks), consts)
  aliases = {1: 1, 2: 2, 3: 3, 4: 4}  # codes and scales in place
  if param:
    p, svec = param
    operands += (p.reshape(n_blocks, -1), svec)
    aliases[6] = 0  # and the parameter
    out_shape = [out_struct(operands[6].shape, p.dtype, *operands)]
  else:
    out_shape = [out_struct((n_blocks, block), jnp.float32, *operands)]
  out_shape += [out_struct(x.shape, x.dtype, *operands) for x in operands[1:5]]
  kernel = functools.partial(_adam_kernel, m_format=m_format, v_format=v_format, nesterov=nesterov, rows=rows,
                             param=bool(param), stochastic=stochastic)
  outs = pl.pallas_call(
      kernel,
      out_shape=tuple(out_shape),
      grid=(n_blocks // rows,),
      input_output_aliases=aliases,
      compiler_params=plt.CompilerParams(num_warps=config.num_warps, num_stages=1),
      interpret=interpret,
      name="jaxlowbit_adam_step" if param else "jaxlowbit_adam_update",
  )(*operands)
  return tuple(out.reshape(x.shape) for out, x in zip(outs, (g, mc, ms, vc, vs)))


# Under GSPMD (jit with sharded parameters, FSDP's update) a bare pallas_call would make XLA
# gather every operand onto each device. The update is independent per block, so the call is
# partitioned like an elementwise op over the blocks: operands in block view ``[*lead, nb, B]``,
# each device runs the kernel on its own blocks; a block's elements stay on one device.
_OPERANDS_RULE = "... b k, ... b c, ... b, ... b e, ... b, h"
_RESULTS_RULE = "... b k, ... b c, ... b, ... b e, ... b"
_WITHIN_BLOCK = ("k", "c", "e", "h")


def _per_block_sharding(sharding, ndim: int):
  """``sharding`` with the within-block (last) dimension replicated, for an operand of rank ``ndim``."""
  spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
  return NamedSharding(sharding.mesh, PartitionSpec(*spec[: ndim - 1], None))


def _partitioned(param: bool):
  """``_call`` under ``custom_partitioning``, with (``param``) or without the parameter operands."""
  n_static = 6  # m_format, v_format, nesterov, config, interpret, stochastic
  n_arrays = 8 if param else 6

  def call(*args):
    arrays, (m_format, v_format, nesterov, config, interpret, stochastic) = args[:n_arrays], args[n_arrays:]
    return _call(*arrays, m_format=m_format, v_format=v_format, nesterov=nesterov, config=config,
                 interpret=interpret, stochastic=stochastic)

  def partition(*args):
    static, (mesh, arg_shapes, result_shape) = args[:n_static], args[n_static:]
    del result_shape
    lead = arg_shapes[0].sharding  # the gradient's sharding of [*lead, nb] decides
    rank = len(arg_shapes[0].shape)
    blocks = _per_block_sharding(lead, rank)
    scales = NamedSharding(blocks.mesh, PartitionSpec(*blocks.spec[: rank - 1]))
    vector = NamedSharding(blocks.mesh, PartitionSpec())
    shardings = (blocks, blocks, scales, blocks, scales, vector) + ((blocks, vector) if param else ())
    results = (blocks, blocks, scales, blocks, scales)
    return mesh, lambda *arrays: call(*arrays, *static), results, shardings

  def infer(*args):
    return partition(*args)[2]

  fn = custom_partitioning(call, static_argnums=tuple(range(n_arrays, n_arrays + n_static)))
  rule = f"{_OPERANDS_RULE}, ... b k, s -> {_RESULTS_RULE}" if param else f"{_OPERANDS_RULE} -> {_RESULTS_RULE}"
  fn.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                   need_replication_factors=_WITHIN_BLOCK + (("s",) if param else ()))
  return fn


_update_call = _partitioned(param=False)
_step_call = _partitioned(param=True)


def _check_supported(g, m, v, m_format, v_format, who: str) -> None:
  if not supported(g, m, v, m_format, v_format):
    raise ValueError(
        f"{who}: gradient {g.shape} {g.dtype} with states {m.codes.shape}/{v.codes.shape} in {m_format} / "
        f"{v_format}: the kernel needs one power-of-two block in [{MIN_BLOCK}, {MAX_BLOCK}] dividing the last axis "
        f"and a float32/bf16/fp16 gradient; use pallas_kernels.dispatch.{who.removesuffix('_kernel')}, which runs "
        "XLA's instead"
    )


def _block_view(x: jax.Array, fmt: BlockFormat | None, block: int) -> jax.Array:
  """``[*lead, N']`` -> ``[*lead, N' / n, n]`` with ``n`` a block's stored elements (free: whole blocks)."""
  n = block // 2 if fmt is not None and fmt.storage_bits == 4 else block
  return x.reshape(*x.shape[:-1], x.shape[-1] // n, n)


def _operands(g, m, v, coefficients, m_format, v_format) -> tuple[jax.Array, ...]:
  """The operands both kernels share, in block view: ``(g, m codes, m scales, v codes, v scales, constants)``."""
  block = m_format.block
  return (_block_view(g, None, block), _block_view(m.codes, m_format, block), m.scale,
          _block_view(v.codes, v_format, block), v.scale, constants(coefficients, m_format, v_format))


@functools.partial(jax.jit, static_argnames=("m_format", "v_format", "nesterov", "config", "interpret"))
def adam_update_kernel(
    g: jax.Array,
    m: BlockQuantized,
    v: BlockQuantized,
    coefficients: AdamCoefficients,
    m_format: BlockFormat,
    v_format: BlockFormat,
    nesterov: bool = False,
    config: AdamKernelConfig = AdamKernelConfig(),
    interpret: bool = False,
) -> tuple[jax.Array, BlockQuantized, BlockQuantized]:
  """One Adam step of a block-wise quantized tensor in one kernel.

  Args:
    g: gradient ``[*lead, N]`` (float32, bfloat16 or float16), ``N`` a multiple of the block.
    m, v: the moments (:class:`BlockQuantized`: codes ``[*lead, N]`` or ``[*lead, N / 2]``,
      float32 scales ``[*lead, N / B]``) stored in ``m_format`` / ``v_format``.
    coefficients: the step's :class:`~jaxlowbit_numerics.adam.AdamCoefficients` (floats or
      float32 scalars; traced values are fine).
    m_format, v_format: the moments' formats (one block size).
    nesterov: Nesterov's update, as ``optax.scale_by_adam(nesterov=True)``.
    config: launch configuration.
    interpret: run in Pallas interpret mode (CPU tests).

  Returns:
    ``(u, m_new, v_new)``: the float32 update ``[*lead, N]`` and the new moments, as
    :func:`adam_update_reference` returns them (the codes and scales are written in place of
    the inputs' when XLA may reuse those buffers: a donated state). Sharded operands (GSPMD)
    are updated where they are: each device runs the kernel on its blocks.
  """
  _check_supported(g, m, v, m_format, v_format, "adam_update_kernel")
  u, mc, ms, vc, vs = _update_call(*_operands(g, m, v, coefficients, m_format, v_format),
                                   m_format, v_format, nesterov, config, interpret, False)
  return (u.reshape(g.shape), BlockQuantized(mc.reshape(m.codes.shape), ms),
          BlockQuantized(vc.reshape(v.codes.shape), vs))


@functools.partial(jax.jit, static_argnames=("m_format", "v_format", "nesterov", "config", "interpret"))
def adam_step_kernel(
    p: jax.Array,
    g: jax.Array,
    m: BlockQuantized,
    v: BlockQuantized,
    coefficients: AdamCoefficients,
    neg_lr: jax.Array,
    weight_decay: jax.Array,
    seed: jax.Array | None,
    m_format: BlockFormat,
    v_format: BlockFormat,
    nesterov: bool = False,
    config: AdamKernelConfig = AdamKernelConfig(),
    interpret: bool = False,
) -> tuple[jax.Array, BlockQuantized, BlockQuantized]:
  """One AdamW step written into the parameter: :func:`adam_update_kernel` that also reads ``p``
  and writes ``apply_update(p, u, neg_lr, weight_decay)`` in its place, so ``u`` never reaches memory.

  Args:
    p: parameter ``[*lead, N]``, float32 or bfloat16 (the gradient's shape).
    g, m, v, coefficients, m_format, v_format, nesterov, config, interpret: as in
      :func:`adam_update_kernel`.
    neg_lr: float32 scalar ``-learning_rate``; weight_decay: float32 scalar (0: no decay).
    seed: uint32 scalar: a bfloat16 ``p`` is rounded stochastically with
      ``hash_bits(flat index, seed)`` (the flat index within each device's block of ``p``); None:
      rounded to nearest.

  Returns:
    ``(p_new, m_new, v_new)``, as :func:`adam_step_reference` (``p_new`` in ``p``'s dtype, in
    place of ``p`` when it is donated).
  """
  _check_supported(g, m, v, m_format, v_format, "adam_step_kernel")
  if p.shape != g.shape or jnp.dtype(p.dtype) not in PARAM_DTYPES:
    raise ValueError(f"adam_step_kernel: parameter {p.shape} {p.dtype} for gradient {g.shape}: the kernel needs the "
                     "gradient's shape and a float32 or bfloat16 parameter")
  stochastic = seed is not None
  p_new, mc, ms, vc, vs = _step_call(
      *_operands(g, m, v, coefficients, m_format, v_format), _block_view(p, None, m_format.block),
      step_vector(neg_lr, weight_decay, seed if stochastic else 0), m_format, v_format, nesterov, config, interpret,
      stochastic)
  return (p_new.reshape(p.shape), BlockQuantized(mc.reshape(m.codes.shape), ms),
          BlockQuantized(vc.reshape(v.codes.shape), vs))


def adam_update_reference(
    g: jax.Array,
    m: BlockQuantized,
    v: BlockQuantized,
    coefficients: AdamCoefficients,
    m_format: BlockFormat,
    v_format: BlockFormat,
    nesterov: bool = False,
) -> tuple[jax.Array, BlockQuantized, BlockQuantized]:
  """:func:`adam_update_kernel` in XLA (any shape the formats store): decode the moments to
  float32, one Adam step, re-encode. The update every backend runs where the kernel does not."""
  g = g.astype(jnp.float32)
  m = dequantize_blockwise(m, m_format, g.shape)
  v = dequantize_blockwise(v, v_format, g.shape)
  u, m_new, v_new = adam_moments(g, m, v, coefficients, nesterov)
  m_new, v_new = fit_moments(g, m, v, m_new, v_new, coefficients)  # overflowed v: the pair scaled down
  return u, quantize_blockwise(m_new, m_format), quantize_blockwise(v_new, v_format)


def adam_step_reference(
    p: jax.Array,
    g: jax.Array,
    m: BlockQuantized,
    v: BlockQuantized,
    coefficients: AdamCoefficients,
    neg_lr: jax.Array,
    weight_decay: jax.Array,
    seed: jax.Array | None,
    m_format: BlockFormat,
    v_format: BlockFormat,
    nesterov: bool = False,
) -> tuple[jax.Array, BlockQuantized, BlockQuantized]:
  """:func:`adam_step_kernel` in XLA: :func:`adam_update_reference`, then ``apply_update`` with
  the same random bits (the flat index of each element of ``p``)."""
  u, m, v = adam_update_reference(g, m, v, coefficients, m_format, v_format, nesterov)
  bits = None if seed is None else flat_index_bits(p.shape, seed)
  return apply_update(p, u, neg_lr, weight_decay, bits), m, v


__all__ = [
    "KERNEL_KINDS",
    "PARAM_DTYPES",
    "AdamKernelConfig",
    "adam_step_kernel",
    "adam_step_reference",
    "adam_update_kernel",
    "adam_update_reference",
    "step_vector",
    "supported",
]
