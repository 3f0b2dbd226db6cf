"""FSDP over a ``jax.shard_map`` mesh axis whose weight all-gathers are low-bit.

Each quantized linear quantizes its local weight shard with the weight's global scale and
all-gathers payload + float32 scales as bytes in ONE collective (ternary packed 2 bits per
value); gradients come back with ``psum_scatter``; every weight's scale for the next step
comes from one all-reduce (``precompute_scales``). ``gather.py`` turns a weight shard into the
whole weight as a low-bit operand that the ordinary ``jaxlowbit.quantized_matmul`` consumes
(``linear.py`` is the two together), ``plan.py`` has the sharding rule, ``scales.py`` the scale
all-reduce.

Typical use with a Linen model (its linears from ``jaxlowbit.dense_for`` / jaxlowbit layers,
or plain ``nn.Dense`` with ``recipe=`` given to the plan)::

    from jaxlowbit import fsdp
    fsdp.initialize_distributed()                          # multi-host: no-op unless configured
    mesh = fsdp.make_mesh(fsdp=-1)                         # all devices on the FSDP axis
    plan = fsdp.plan_for_model(model, params, example_x, mesh=mesh)
    params = fsdp.shard_params(params, plan)
    opt_state = fsdp.init_optimizer(optimizer, params, plan)
    scales = fsdp.precompute_scales(params, plan)

    def loss_fn(params, scales, batch):                    # one device's view, inside shard_map
      logits = fsdp.apply(model, params, batch["x"], plan=plan, scales=scales)
      return cross_entropy(logits, batch["y"]).mean()

    step = fsdp.train_step(loss_fn, optimizer, plan)
    params, opt_state, scales, loss = step(params, opt_state, scales, fsdp.shard_batch(batch, plan))

Tensor parallelism: ``make_mesh(fsdp=..., tensor=t)`` adds a ``tensor`` axis and
``plan_for_model(..., tensor_parallel={"attn.q": COLUMN, "attn.out": ROW, ...})`` names the
column- and row-parallel linears; activations entering column-parallel linears are all-gathered
8-bit (``tensor.py``) and the model reads ``tensor_parallel()`` while ``apply`` runs it.

Multi-host: start one process per host with your scheduler and set
``JAX_COORDINATOR_ADDRESS=host0:port``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` (or run
under SLURM / Open MPI / Kubernetes and call ``initialize_distributed(cluster=True)``);
see ``distributed.py``.
"""

from jaxlowbit.fsdp.config import REMAT_MODES, FsdpConfig
from jaxlowbit.fsdp.distributed import initialize_distributed
from jaxlowbit.fsdp.gather import gather_weight, global_scale, weight_scaling
from jaxlowbit.fsdp.linear import fsdp_linear
from jaxlowbit.fsdp.linen import apply, linears_of, plan_for_model
from jaxlowbit.fsdp.plan import FsdpPlan, LinearWeight, make_mesh, make_plan, shard_batch, shard_params
from jaxlowbit.fsdp.scales import precompute_scales
from jaxlowbit.fsdp.tensor import (
    COLUMN,
    FEATURES,
    ROW,
    ColumnParallel,
    RowParallel,
    TensorParallel,
    TensorSplit,
    gather_activation,
    tensor_parallel,
)
from jaxlowbit.scaling import WeightScaling
from jaxlowbit.fsdp.step import apply_update, evaluate, init_optimizer, train_step, value_and_grad

__all__ = [
    "COLUMN",
    "FEATURES",
    "REMAT_MODES",
    "ROW",
    "ColumnParallel",
    "FsdpConfig",
    "FsdpPlan",
    "LinearWeight",
    "RowParallel",
    "TensorParallel",
    "TensorSplit",
    "WeightScaling",
    "apply",
    "apply_update",
    "evaluate",
    "fsdp_linear",
    "gather_activation",
    "gather_weight",
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
    "tensor_parallel",
    "train_step",
    "value_and_grad",
    "weight_scaling",
]
