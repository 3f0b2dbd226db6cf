"""Parallel training: the mesh, FSDP with low-bit weight gathers, tensor parallelism, multi-process start-up.

==================  ==========================================================================
module              holds
==================  ==========================================================================
``mesh``            the axis names (``MeshAxes``) and ``make_mesh``: a ``(data, fsdp[, tensor])`` mesh
``fsdp/``           FSDP: the plan, the low-bit weight gather, scales, the Linen runner, steps
``tensor``          tensor parallelism: 8-bit activation gathers, column- and row-parallel linears
``wire``            one shard's bytes on the wire (both gathers' messages)
``distributed``     ``initialize_distributed``: ``jax.distributed.initialize`` from the environment
``hlo``             the collectives of a compiled program (what tests and benchmarks count)
``overlap``         XLA:GPU options that overlap collectives with compute (``jax.jit(compiler_options=)``)
==================  ==========================================================================

``jaxlowbit.fsdp`` is this package under the name the first releases gave it: it re-exports
every name below, so ``from jaxlowbit import fsdp`` code keeps working.

Typical use with a Linen model (its linears from ``jaxlowbit.dense_for`` / jaxlowbit layers,
or plain ``nn.Dense`` with ``recipe=`` given to the plan)::

    from jaxlowbit import parallel
    parallel.initialize_distributed()                      # multi-host: no-op unless configured
    mesh = parallel.make_mesh(fsdp=-1)                     # all devices on the FSDP axis
    plan = parallel.plan_for_model(model, params, example_x, mesh=mesh)
    params = parallel.shard_params(params, plan)
    opt_state = parallel.init_optimizer(optimizer, params, plan)
    scales = parallel.precompute_scales(params, plan)

    def loss_fn(params, scales, batch):                    # one device's view, inside shard_map
      logits = parallel.apply(model, params, batch["x"], plan=plan, scales=scales)
      return cross_entropy(logits, batch["y"]).mean()

    step = parallel.train_step(loss_fn, optimizer, plan)
    params, opt_state, scales, loss = step(params, opt_state, scales, parallel.shard_batch(batch, plan))

Tensor parallelism: ``make_mesh(fsdp=..., tensor=t)`` adds a ``tensor`` axis and
``plan_for_model(..., tensor_parallel={"attn.q": COLUMN, "attn.out": ROW, ...})`` names the
column- and row-parallel linears; activations entering column-parallel linears are all-gathered
8-bit (``tensor.py``). ``apply`` hands the model its :class:`TensorParallel` explicitly: a model
that declares a field ``execution`` (a ``jaxlowbit.ExecutionOptions``) is run as
``model.clone(execution=...)`` with ``execution.tensor_parallel`` set (``train/model.py`` does).

Multi-host: start one process per host with your scheduler and set
``JAX_COORDINATOR_ADDRESS=host0:port``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` (or run
under SLURM / Open MPI / Kubernetes and call ``initialize_distributed(cluster=True)``);
see ``distributed.py``.
"""

from jaxlowbit.parallel import hlo, overlap, wire
from jaxlowbit.parallel.distributed import initialize_distributed
from jaxlowbit.parallel.fsdp import (
    GRAD_REDUCE_DTYPES,
    REMAT_MODES,
    FsdpConfig,
    FsdpPlan,
    LinearWeight,
    apply,
    apply_update,
    evaluate,
    fsdp_linear,
    gather_param,
    gather_weight,
    global_scale,
    init_optimizer,
    linears_of,
    make_plan,
    plan_for_model,
    precompute_scales,
    shard_batch,
    shard_params,
    train_step,
    value_and_grad,
    weight_scaling,
)
from jaxlowbit.parallel.mesh import MeshAxes, make_mesh
from jaxlowbit.parallel.tensor import (
    COLUMN,
    FEATURES,
    ROW,
    ColumnGroups,
    ColumnParallel,
    RowParallel,
    TensorParallel,
    TensorSplit,
    gather_activation,
    tensor_parallel,
)
from jaxlowbit.scaling import WeightScaling

__all__ = [
    "COLUMN",
    "FEATURES",
    "GRAD_REDUCE_DTYPES",
    "REMAT_MODES",
    "ROW",
    "ColumnGroups",
    "ColumnParallel",
    "FsdpConfig",
    "FsdpPlan",
    "LinearWeight",
    "MeshAxes",
    "RowParallel",
    "TensorParallel",
    "TensorSplit",
    "WeightScaling",
    "apply",
    "apply_update",
    "evaluate",
    "fsdp_linear",
    "gather_activation",
    "gather_param",
    "gather_weight",
    "global_scale",
    "hlo",
    "init_optimizer",
    "initialize_distributed",
    "linears_of",
    "make_mesh",
    "make_plan",
    "overlap",
    "plan_for_model",
    "precompute_scales",
    "shard_batch",
    "shard_params",
    "tensor_parallel",
    "train_step",
    "value_and_grad",
    "weight_scaling",
    "wire",
]
