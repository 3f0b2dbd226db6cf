"""FSDP over a ``jax.shard_map`` mesh axis whose weight all-gathers are low-bit.

Each quantized linear quantizes its local weight shard with the weight's global scale and
all-gathers payload + float32 scales as bytes in ONE collective (ternary packed 2 bits per
value); gradients come back with ``psum_scatter``; every weight's scale for the next step
comes from one all-reduce (``precompute_scales``). See ``linear.py`` for the numerics,
``plan.py`` for the sharding rule.

Typical use with a Linen model::

    from jaxlowbit import fsdp
    mesh = fsdp.make_mesh(fsdp=-1)                         # all devices on the FSDP axis
    plan = fsdp.plan_for_model(model, params, example_x, mesh=mesh)
    params = fsdp.shard_params(params, plan)
    opt_state = fsdp.init_optimizer(optimizer, params, plan)
    scales = fsdp.precompute_scales(params, plan)

    def loss_fn(params, scales, batch):                    # one device's view
      logits = fsdp.apply(model, params, batch["x"], plan=plan, scales=scales)
      return cross_entropy(logits, batch["y"]).mean()

    step = fsdp.train_step(loss_fn, optimizer, plan)
    params, opt_state, scales, loss = step(params, opt_state, scales, fsdp.shard_batch(batch, plan))
"""

from jaxlowbit.fsdp.config import REMAT_MODES, FsdpConfig
from jaxlowbit.fsdp.distributed import initialize_distributed
from jaxlowbit.fsdp.linear import fsdp_linear, global_scale
from jaxlowbit.fsdp.linen import apply, linears_of, plan_for_model
from jaxlowbit.fsdp.plan import FsdpPlan, LinearWeight, make_mesh, make_plan, shard_batch, shard_params
from jaxlowbit.fsdp.scales import precompute_scales
from jaxlowbit.fsdp.scaling import WeightScaling, weight_scaling
from jaxlowbit.fsdp.step import init_optimizer, train_step, value_and_grad

__all__ = [
    "REMAT_MODES",
    "FsdpConfig",
    "FsdpPlan",
    "LinearWeight",
    "WeightScaling",
    "apply",
    "fsdp_linear",
    "global_scale",
    "init_optimizer",
    "initialize_distributed",
    "linears_of",
    "make_mesh",
    "make_plan",
    "plan_for_model",
    "precompute_scales",
    "shard_batch",
    "shard_params",
    "train_step",
    "value_and_grad",
    "weight_scaling",
]
