"""One training step for any gradient source: the state, the step and eval factories.

A gradient source is any function ``(params, batch, key=None) -> (loss, grads)``
(``key``: the step's dropout key, ignored by a model without dropout):
``grad_source("auto", config)`` wraps ``jax.value_and_grad(loss_fn)``,
``grad_source("manual", config)`` the hand-derived ``manual_grads.value_and_grad``
(grad_sources.py; imported from here too).
``make_train_step(grad_fn, optimizer)`` turns either, with any optax
``GradientTransformation``, into the same jitted step

    state, metrics = step(state, batch)   # metrics: loss, grad_norm, update_norm, lr (when injected)

A ``StepSpec`` (config, gradient source, optimizer items, dtype, mesh key) names one
compiled step of the loop; the builders below are cached on it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxformer.model.config import ModelConfig
from jaxformer.model.lora import LoraConfig, init_adapters
from jaxformer.model.params import init_params, validate_params
from jaxformer.model.transformer import loss_fn
from jaxformer.training.adapters import lora_grad_source
from jaxformer.training.grad_sources import GradFn, check_grad_fn, grad_source, moe_grad_source  # noqa: F401
from jaxformer.training.optim import current_muon_lr, injected_lr, make_optimizer
from jaxformer.training.settings import TrainSettings
from jaxformer.training.sharding import make_mesh, mesh_shardings, state_shardings


class TrainState(NamedTuple):
    step: jax.Array  # () int32: optimizer calls made so far (micro-steps with accumulation)
    params: Any  # the params pytree of DESIGN.md
    opt_state: Any  # the optimizer's state
    data_index: jax.Array  # () int32: index of the next training batch (Batcher.batch)
    rng: jax.Array  # (2,) uint32 key stream of the run: a step with dropout splits off its key


def init_state(params, optimizer: optax.GradientTransformation, seed: int = 0) -> TrainState:
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        data_index=jnp.zeros((), jnp.int32),
        rng=jax.random.PRNGKey(seed),
    )


def check_init_vocab(params, config: ModelConfig) -> None:
    """The vocabulary of ``params`` (their tok_embed rows) must be ``config``'s, the
    tokenizer's: ValueError otherwise (the loop asks before it compiles the step)."""
    rows = getattr(params.get("tok_embed") if isinstance(params, dict) else None, "shape", (None,))[0]
    if rows is not None and rows != config.vocab_size:
        raise ValueError(f"the initial model's vocabulary has {rows} tokens, the tokenizer's "
                         f"{config.vocab_size}: train it with the tokenizer it was made for")


def with_params(state: TrainState, params, config: ModelConfig) -> TrainState:
    """``state`` with ``params`` (host arrays, e.g. an imported model) in place of its
    own, in its dtypes and layout; ValueError naming the first leaf that does not fit
    ``config`` (a vocabulary other than the tokenizer's names tok_embed). The optimizer
    state of sgd / momentum / adam(w) / muon does not depend on the params' values."""
    check_init_vocab(params, config)
    validate_params(params, config)
    return state._replace(params=jax.tree_util.tree_map(
        lambda new, old: jax.device_put(jnp.asarray(new, old.dtype), old.sharding), params, state.params))


def layer_grad_norms(grads) -> dict:
    """The gradient norm of each layer: ``grad_norm/embed`` (token and position
    embeddings), ``grad_norm/block{i}`` (block i's slice of every blocks leaf) and
    ``grad_norm/head`` (final norm and head). {} for trees without the params layout."""
    if not isinstance(grads, dict) or "blocks" not in grads:
        return {}
    group = lambda keys: optax.tree.norm({k: grads[k] for k in keys if k in grads})  # noqa: E731
    leaves = jax.tree_util.tree_leaves(grads["blocks"])
    per_block = sum(jnp.sum(jnp.square(g.reshape(g.shape[0], -1)), axis=1) for g in leaves)  # (L,)
    per_block = jnp.sqrt(per_block)
    out = {"grad_norm/embed": group(("tok_embed", "pos_embed"))}
    out.update({f"grad_norm/block{i}": per_block[i] for i in range(per_block.shape[0])})
    out["grad_norm/head"] = group(("ln_f", "head"))
    return out


def make_train_step(grad_fn: GradFn, optimizer: optax.GradientTransformation, *,
                    mesh: Mesh | None = None, donate: bool = True, state_sharding=None, frozen=None):
    """One jitted training step ``(state, batch) -> (state, metrics)`` for any gradient
    source and any optax ``GradientTransformation`` (``optax.adamw(1e-3)``, a chain,
    ``optax.MultiSteps``, ``make_optimizer``'s). The input state's buffers are donated
    (do not reuse it after the call). ``grad_fn(params, batch, key)`` gets a key split
    off ``state.rng`` each step (dropout draws its masks from it; a source without
    dropout ignores it), so the key stream lives in the checkpoint.

    With a ``mesh`` (sharding.make_mesh), the batch is split along its first axis over
    data x fsdp, and the state laid out by ``state_sharding`` (a TrainState of
    NamedShardings, sharding.state_shardings; default: replicated): jit inserts the
    collectives. The metrics come back replicated and stay on the device.
    metrics: loss, grad_norm (global norm of the gradient), update_norm, the per-layer
    norms of ``layer_grad_norms``, and lr when the optimizer state holds an injected
    learning rate (``optim.injected_lr``: ``optax.inject_hyperparams``, every
    ``make_optimizer``; muon_lr too for the muon optimizer); no lr otherwise.
    ``frozen``: params the step passes to ``grad_fn(params, batch, key, frozen)`` as an argument
    of the compiled program (a LoRA run's base; training/adapters.py); state.params are trained.
    """
    check_grad_fn(grad_fn)

    def step(state: TrainState, batch, *frozen):
        rng, key = jax.random.split(state.rng)  # this step's key comes off the state's key stream
        loss, grads, *extra = grad_fn(state.params, batch, key, *frozen)  # extra: a metrics dict (MoE)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = TrainState(state.step + 1, params, opt_state, state.data_index + 1, rng)
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "update_norm": optax.tree.norm(updates),
        }
        lr = injected_lr(opt_state)
        if lr is not None:  # a rate the state holds (inject_hyperparams); a constant has none
            metrics["lr"] = lr
        metrics.update(layer_grad_norms(grads))
        for more in extra:
            metrics.update(more)
        muon_lr = current_muon_lr(opt_state)
        if muon_lr is not None:  # optimizer muon: the matrices' rate beside AdamW's lr
            metrics["muon_lr"] = muon_lr
        return new_state, metrics

    kwargs = {"donate_argnums": (0,)} if donate else {}
    if mesh is not None:
        replicated, split = mesh_shardings(mesh)
        layout = replicated if state_sharding is None else state_sharding
        kwargs.update(in_shardings=(layout, split) + (() if frozen is None else (replicated,)),
                      out_shardings=(layout, replicated))
        jitted = jax.jit(_under_mesh(step, mesh), **kwargs)
    else:
        jitted = jax.jit(step, **kwargs)
    return jitted if frozen is None else WithFrozen(jitted, frozen)


class WithFrozen(NamedTuple):
    """A step (jitted, lowered or compiled) ``f(state, batch, frozen)`` called as ``(state, batch)``:
    the frozen params of a LoRA run are an argument of the compiled step, never a constant."""
    f: Any
    frozen: Any

    def __call__(self, state, batch):
        return self.f(state, batch, self.frozen)

    def lower(self, state, batch):
        return WithFrozen(self.f.lower(state, batch, self.frozen), self.frozen)

    def compile(self):
        return WithFrozen(self.f.compile(), self.frozen)

    def memory_analysis(self):
        return self.f.memory_analysis()

    def cost_analysis(self):
        return self.f.cost_analysis()


def _under_mesh(step, mesh: Mesh):
    """``step`` traced with ``mesh`` as the context's abstract mesh, so that a layer that
    must run per shard (the Pallas kernel: kernels.shards.per_example_shards) sees it."""
    abstract = getattr(mesh, "abstract_mesh", mesh)  # a Mesh's, or an AbstractMesh itself

    @functools.wraps(step)
    def traced(state, batch, *frozen):
        with jax.sharding.use_abstract_mesh(abstract):
            return step(state, batch, *frozen)
    return traced


def make_eval_step(config: ModelConfig, mesh: Mesh | None = None):
    """Jitted ``(params, batch) -> loss``. On a mesh with an expert axis it is traced under the
    mesh, as the train step is, so that the MoE layers keep their experts split and exchange
    the tokens (model/moe_parallel.py) rather than gather every expert on each device; on one
    with a tensor or context axis so that the blocks run tensor or context parallel
    (model/parallel/tensor.py, context.py)."""
    kwargs = {}
    loss = lambda params, batch: loss_fn(params, batch, config)  # noqa: E731
    if mesh is not None:
        replicated, _ = mesh_shardings(mesh)
        kwargs.update(out_shardings=replicated)
        if {"expert", "tensor", "context"} & set(mesh.axis_names):
            loss = _under_mesh(loss, mesh)
    return jax.jit(loss, **kwargs)


# The builders the loop uses, cached on a StepSpec: runs in one process with the same
# model, optimizer and mesh share one compiled step (a resumed run, a test suite): jit
# caches per function object.


def optimizer_items(settings: TrainSettings) -> tuple:
    """The run's optimizer arguments as sorted (name, value) pairs, hashable."""
    return tuple(sorted(settings.optimizer_kwargs().items()))


def mesh_key(mesh: Mesh) -> tuple[tuple, tuple[int, int]]:
    """(devices, (data, fsdp) shape) of ``mesh``, hashable."""
    return tuple(mesh.devices.flat), tuple(mesh.devices.shape)


class Frozen:
    """A LoRA run's frozen params, hashed by identity (a StepSpec field)."""

    def __init__(self, params):
        self.params = params


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What one compiled train step is, hashable: the key of every cached builder."""

    config: ModelConfig
    grads: str | GradFn | None = None  # a gradient source's name (GRAD_SOURCES) or the function
    opt_items: tuple = ()  # make_optimizer's arguments as sorted (name, value) pairs
    dtype: str = "float32"  # the params' dtype
    mesh_key: tuple = ()  # (devices, (data, fsdp)): mesh_key(mesh); () for the default devices
    lora: LoraConfig | None = None  # a LoRA run's: the state's params are the adapters
    frozen: Frozen | None = None  # a LoRA run's frozen base, passed to each step

    @classmethod
    def of_run(cls, settings: TrainSettings, config: ModelConfig, mesh: Mesh,
               grad_fn: GradFn | None = None, frozen=None) -> StepSpec:
        """The step of a run of ``settings`` on ``mesh`` (``grad_fn``: instead of settings.grads;
        ``frozen``: a LoRA run's base params)."""
        return cls(config, grad_fn or settings.grads, optimizer_items(settings), settings.dtype,
                   mesh_key(mesh), settings.lora(), None if frozen is None else Frozen(frozen))

    def replace(self, **changes) -> StepSpec:
        return dataclasses.replace(self, **changes)

    @property
    def state_part(self) -> StepSpec:
        """The spec without its gradient source: all the train state depends on."""
        return self.replace(grads=None, frozen=None)

    def mesh(self) -> Mesh:
        return make_mesh(*self.mesh_key) if self.mesh_key else make_mesh()

    def grad_fn(self) -> GradFn:
        if self.grads is None:
            raise ValueError("StepSpec.grads is None: name a gradient source (auto, manual) or give one")
        if not isinstance(self.grads, str):
            return self.grads
        if self.lora is not None:
            return lora_grad_source(self.grads, self.config, self.lora)
        return grad_source(self.grads, self.config)

    def optimizer(self) -> optax.GradientTransformation:
        return _optimizer(self.opt_items)


@functools.lru_cache(maxsize=8)
def _optimizer(opt_items: tuple) -> optax.GradientTransformation:
    return make_optimizer(**dict(opt_items))


def _init_state_fn(spec: StepSpec):
    def init(seed):
        params = init_params(jax.random.PRNGKey(seed), spec.config, dtype=jnp.dtype(spec.dtype))
        if spec.lora is not None:  # the adapters alone are trained (and checkpointed)
            params = init_adapters(jax.random.fold_in(jax.random.PRNGKey(seed), 1), params, spec.lora)
        return init_state(params, spec.optimizer(), seed)

    return init


@functools.lru_cache(maxsize=8)
def _state_sharding(spec: StepSpec):
    """The TrainState's NamedShardings on the mesh (sharding.state_shardings)."""
    return state_shardings(jax.eval_shape(_init_state_fn(spec), 0), spec.mesh())


@functools.lru_cache(maxsize=8)
def _init_fn(spec: StepSpec):
    return jax.jit(_init_state_fn(spec), out_shardings=_state_sharding(spec))


def init_fn(spec: StepSpec):
    """Jitted seed -> the initial TrainState, laid out on the mesh (one compile
    instead of one per random draw; each device computes only its own shards)."""
    return _init_fn(spec.state_part)


@functools.lru_cache(maxsize=8)
def compiled_step(spec: StepSpec):
    """The jitted step of ``spec`` on its mesh."""
    return make_train_step(spec.grad_fn(), spec.optimizer(), mesh=spec.mesh(),
                           state_sharding=_state_sharding(spec.state_part),
                           frozen=None if spec.frozen is None else spec.frozen.params)


@functools.lru_cache(maxsize=8)
def _eval_step(config: ModelConfig, mesh_key: tuple):
    return make_eval_step(config, StepSpec(config, mesh_key=mesh_key).mesh())


def compiled_eval_step(spec: StepSpec):
    """The jitted ``(params, batch) -> loss`` on the spec's mesh."""
    return _eval_step(spec.config, spec.mesh_key)


def state_template(config: ModelConfig, meta: dict) -> TrainState:
    """The shapes and dtypes (``jax.ShapeDtypeStruct``) of the TrainState a run's
    checkpoint holds, from its ``meta`` (train settings, param dtype): the template
    ``checkpoints.runs.load_state`` restores into."""
    settings = TrainSettings.from_dict(meta["settings"])
    spec = StepSpec(config, opt_items=optimizer_items(settings), dtype=meta.get("param_dtype", "float32"),
                    lora=settings.lora())
    return jax.eval_shape(_init_state_fn(spec), 0)
