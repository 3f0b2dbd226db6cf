"""The low-bit numerics that jaxlowbit and its kernels share: formats, scales and statistics.

``jaxlowbit`` (the library) and ``pallas_kernels`` (the kernels it dispatches to) both import
these modules, and these modules import neither, so imports run one way::

    jaxlowbit  ->  pallas_kernels  ->  jaxlowbit_numerics
        \\_____________________________________^

- :mod:`~jaxlowbit_numerics.int8`: symmetric int8 quantization (``scale = amax / 127``).
- :mod:`~jaxlowbit_numerics.fp8`: e4m3fn / e5m2 with float32 multipliers and saturating casts.
- :mod:`~jaxlowbit_numerics.ternary`: BitNet b1.58 absmean ternary weights and 2-bit packing.
- :mod:`~jaxlowbit_numerics.stats`: the abs-max / abs-mean statistics scales are built from.
- :mod:`~jaxlowbit_numerics.formats`: ``QuantSpec``, how one matmul operand is quantized.
- :mod:`~jaxlowbit_numerics.blockwise`: block-wise quantized tensors (low-bit optimizer states;
  public as ``jaxlowbit.qstate``).
- :mod:`~jaxlowbit_numerics.adam`: the Adam step's elementwise arithmetic, shared by the XLA
  update and the fused optimizer kernel.

Users reach the public functions through ``jaxlowbit`` (``jaxlowbit.quantize_int8`` ...).
"""
