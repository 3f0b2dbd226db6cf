"""FSDP over a ``jax.shard_map`` mesh axis whose weight all-gathers are low-bit.

Each quantized linear quantizes its local weight shard with the weight's global scale and
all-gathers payload + float32 scales as bytes in ONE collective (ternary packed 2 bits per
value); gradients come back with ``psum_scatter``; every weight's scale for the next step
comes from one all-reduce (``precompute_scales``).

==============  ==============================================================================
module          holds
==============  ==============================================================================
``config``      :class:`FsdpConfig`: the axis names and FSDP's options
``plan``        :class:`FsdpPlan`: which leaf is sharded along which dim (and split over tensor)
``gather``      ``gather_weight``: a weight shard -> the whole weight as a low-bit operand
``linear``      ``fsdp_linear``: the gather, then the ordinary ``jaxlowbit.quantized_matmul``
``scales``      ``precompute_scales``: every weight's next scale in one all-reduce
``linen``       a Linen model's plan (``plan_for_model``) and its run on shards (``apply``)
``step``        ``value_and_grad`` / ``train_step`` over a plan
==============  ==============================================================================
"""

from jaxlowbit.parallel.fsdp.config import GRAD_REDUCE_DTYPES, REMAT_MODES, FsdpConfig
from jaxlowbit.parallel.fsdp.gather import gather_param, gather_weight, global_scale, weight_scaling
from jaxlowbit.parallel.fsdp.linear import fsdp_linear
from jaxlowbit.parallel.fsdp.linen import apply, linears_of, plan_for_model
from jaxlowbit.parallel.fsdp.plan import FsdpPlan, LinearWeight, make_plan, shard_batch, shard_params
from jaxlowbit.parallel.fsdp.scales import precompute_scales
from jaxlowbit.parallel.fsdp.step import apply_update, evaluate, init_optimizer, train_step, value_and_grad

__all__ = [
    "GRAD_REDUCE_DTYPES",
    "REMAT_MODES",
    "FsdpConfig",
    "FsdpPlan",
    "LinearWeight",
    "apply",
    "apply_update",
    "evaluate",
    "fsdp_linear",
    "gather_param",
    "gather_weight",
    "global_scale",
    "init_optimizer",
    "linears_of",
    "make_plan",
    "plan_for_model",
    "precompute_scales",
    "shard_batch",
    "shard_params",
    "train_step",
    "value_and_grad",
    "weight_scaling",
]
