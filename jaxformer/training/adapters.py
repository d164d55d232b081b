"""A LoRA run's pieces: its gradient sources over the adapters, its evaluation, its frozen base.

A run with ``lora_rank`` > 0 trains only adapters (jaxformer/model/lora.py): TrainState.params
is the adapters' tree, so the optimizer state and the checkpoints hold the adapters alone. The
frozen base (``--init-from``'s model, else the seed's init) is an argument of the compiled step
and evaluation (make_train_step's ``frozen``), never a constant folded into them; the
run's settings keep where it came from (``lora_base``) and its sha256 (``lora_base_digest``),
so a resumed run reads it again and refuses another. ``base_quant`` says how the base's
projections are held (jaxformer/model/quantized.py): float, a GGUF file's own blocks (keep), or
int8; the digest is of what is held, so a resume reads it the same way.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np

import manual_grads.adapters
from jaxformer.formats.gguf_file import read_gguf
from jaxformer.formats.hf import is_gguf, read_hf, resolve_source
from jaxformer.model.config import ModelConfig
from jaxformer.model.lora import LoraConfig, attach, merge
from jaxformer.model.params import init_params
from jaxformer.model.quantized import held_as, is_quantized, quantize_base
from jaxformer.model.transformer import loss_fn
from jaxformer.training.settings import TrainSettings


def lora_loss_fn(adapters, batch, base, config, lora: LoraConfig, key=None, loss=loss_fn):
    """The loss of the base params with ``adapters`` attached: jax.grad of it w.r.t. adapters
    is the adapters' gradient. ``key``: the step's dropout key (the model's dropout and the
    adapters'); ``loss``: the model's loss_fn (manual_grads.custom_vjp's runs the manual rules)."""
    return loss(attach(base, adapters, lora, key), batch, config, key=key)


def read_base(source, settings):
    """The frozen params of ``source`` (a model folder, hub id or GGUF file) held as
    ``settings.base_quant`` says: float in the run's dtype, the GGUF blocks kept, or int8.
    ValueError (one line) for keep on a source that is not a GGUF file."""
    dtype = np.dtype(settings.dtype)
    folder = resolve_source(source)
    if settings.base_quant == "keep":
        if not is_gguf(folder):
            raise ValueError(f"--base-quant keep holds a GGUF file's blocks; {source} is not a .gguf file "
                             f"(--base-quant int8 quantizes any model)")
        return read_gguf(folder, dtype, keep=True)[0]
    params = read_hf(folder, dtype)[0]
    return quantize_base(params) if settings.base_quant == "int8" else params


def frozen_base(settings, config: ModelConfig):
    """The frozen params of a LoRA run of ``settings``: its ``lora_base`` model read again, else
    the seed's init (what a full run of these settings starts from), in the run's dtype, its
    projections held as ``settings.base_quant`` says (``read_base``)."""
    if settings.lora_base:
        return read_base(settings.lora_base, settings)
    if settings.base_quant == "keep":
        raise ValueError("--base-quant keep holds a GGUF file's blocks: give the file with --init-from")
    dtype = np.dtype(settings.dtype)
    params = jax.jit(init_params, static_argnums=(1, 2))(jax.random.PRNGKey(settings.seed), config, dtype)
    return quantize_base(params) if settings.base_quant == "int8" else params


def base_line(params) -> str:
    """What a frozen base is held as and its bytes, against float32: "the frozen model's
    projections held as q4_1: 20.1 MiB of params (float32: 81.3 MiB)"."""
    leaves = jax.tree_util.tree_leaves(params, is_leaf=is_quantized)
    held = sum(int(a.nbytes) for a in leaves)
    as_f32 = sum(int(np.prod(a.shape)) * 4 for a in leaves)
    return (f"the frozen model's projections held as {held_as(params)}: {held / 2**20:.1f} MiB of params "
            f"(float32: {as_f32 / 2**20:.1f} MiB)")


def model_params(params, config: ModelConfig, meta: dict):
    """The model a run's checkpoint ``params`` stand for: a LoRA run's adapters merged into its
    frozen base (read again), any other run's params as they are."""
    settings = TrainSettings.from_dict(meta["settings"])
    lora = settings.lora()
    return params if lora is None else merge(frozen_base(settings, config), params, lora)


def lora_grad_source(kind: str, config: ModelConfig, lora: LoraConfig):
    """The gradient source ``(adapters, batch, key, base) -> (loss, adapter grads)`` named
    ``kind``: "auto" (jax.grad of the adapted model's loss) or "manual" (by hand: the frozen
    weights' dW never computed). The step passes ``base`` (make_train_step's ``frozen``)."""
    if kind == "auto":
        value_and_grad = jax.value_and_grad(lora_loss_fn)
        return lambda adapters, batch, key=None, base=None: value_and_grad(adapters, batch, base, config,
                                                                           lora, key)
    if kind == "manual":
        return lambda adapters, batch, key=None, base=None: manual_grads.adapters.value_and_grad(
            adapters, batch, base, config, lora, key)
    raise ValueError(f"unknown gradient source {kind!r}; choose one of auto, manual")


def lora_eval_fn(config: ModelConfig, lora: LoraConfig, base):
    """``(adapters, batch) -> loss`` of the base with the adapters (no dropout), jitted with
    ``base`` an argument."""
    jitted = jax.jit(lambda adapters, batch, base: loss_fn(attach(base, adapters, lora), batch, config))
    return lambda adapters, batch: jitted(adapters, batch, base)


def base_digest(params) -> str:
    """sha256 over the frozen params' leaves (path, dtype, shape and bytes), in tree order."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        a = np.ascontiguousarray(jax.device_get(leaf))
        h.update(f"{jax.tree_util.keystr(path)}:{a.dtype}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()
