"""``jaxlowbit.fsdp``: the name :mod:`jaxlowbit.parallel` had before it held more than FSDP.

Every public name of :mod:`jaxlowbit.parallel` (the mesh, FSDP, tensor parallelism, multi-process
start-up) is re-exported here unchanged, so ``from jaxlowbit import fsdp; fsdp.make_mesh(...)``
and ``from jaxlowbit.fsdp import FsdpConfig`` keep working. New code imports ``jaxlowbit.parallel``.
"""

from jaxlowbit.parallel import *  # noqa: F403  (the re-export is this module's whole purpose)
from jaxlowbit.parallel import __all__  # noqa: F401
