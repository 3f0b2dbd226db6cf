"""Block-wise quantized tensors, the storage format of the low-bit optimizer states.

The definitions live in :mod:`jaxlowbit_numerics.blockwise` (the fused optimizer kernel in
``pallas_kernels`` encodes with the same functions, and kernels import only numerics); this
module is their public name, ``jaxlowbit.qstate``.
"""

from jaxlowbit_numerics.blockwise import *  # noqa: F403
from jaxlowbit_numerics.blockwise import __all__  # noqa: F401
