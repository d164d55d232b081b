"""How each platform's branch of the Pallas kernels cuts an attention into tiles and
launches them: the block sizes (ModelConfig.pallas_block_q / pallas_block_k, else the
launch table's tuned choice on a GPU, else the platform's default), the head width the
kernels see, and Triton's warps and stages.

Shape letters as in forward.py: T time, Dh head width, Kq / Kk the query / key block
sizes, Nq = ceil(T / Kq), Nk = ceil(T / Kk), Dp the head width the kernels see (Dh; on a
GPU the next power of two, at least 16, as Triton's tiles need).

``plan`` only reads the launch table (tune.py: ``tune.choice``); nothing here times a
kernel or writes a file. Tuning is its own act (timing.py, ``jaxformer tune``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jax.experimental import pallas as pl

from jaxformer.kernels.pallas import tune as pallas_tune

# (block_q, block_k) when ModelConfig.pallas_block_q / pallas_block_k are 0 (on a GPU: when
# the launch table has no tuned choice for the shape, tune.py). GPU: tiles small enough for
# the backward's float32 accumulators to stay in registers at Dh <= 128. TPU: 128 rows fill
# the MXU. CPU interpret mode pays per grid step and loop turn, so it takes big blocks.
DEFAULT_BLOCKS = {"gpu": (64, 64), "tpu": (128, 128), "cpu": (128, 128)}
DEFAULT_WARPS, DEFAULT_STAGES = 4, 2  # Triton's launch when untuned
MIN_GPU_TILE = 16  # Triton's smallest matmul tile side
TPU_SUBLANES = 8  # a TPU block's second-to-last side: a multiple of 8 (or the whole axis)


class Tiling(NamedTuple):
    """How a length-T, width-Dh attention is cut into tiles (all static Python ints)."""
    T: int  # the unpadded length
    Kq: int  # query block size
    Kk: int  # key block size
    Nq: int  # query blocks: ceil(T / Kq)
    Nk: int  # key blocks: ceil(T / Kk)
    Dh: int  # the head width
    Dp: int  # the head width the kernels see: Dh, or padded to Triton's tile


class Launch(NamedTuple):
    """How a branch launches its pallas_calls (static)."""
    device: str  # "gpu" (Triton), "tpu" (Mosaic) or "cpu" (interpret mode)
    interpret: Any = False  # pallas_call's interpret: True on "cpu"; tests run gpu/tpu plans with True
    num_warps: int = DEFAULT_WARPS  # Triton only
    num_stages: int = DEFAULT_STAGES  # Triton only


class TilingError(ValueError):
    """Block sizes a device cannot take (raised while its branch is traced; platform.py
    defers it to the lowering for that device)."""


def _tile_side(name: str, block: int, T: int, device: str) -> int:
    """The block size used for length T: ``block``, cut down when T is shorter (to T on
    CPU, to the power of two covering T, at least 16, on a GPU, to T rounded up to 8 on
    a TPU). ValueError naming the field where the device cannot take ``block``."""
    if device == "gpu":
        if block < MIN_GPU_TILE or block & (block - 1):
            raise TilingError(f"ModelConfig.{name} must be a power of two >= {MIN_GPU_TILE} on a GPU "
                             f"(Triton's tiles), got {block}")
        return min(block, max(MIN_GPU_TILE, pl.next_power_of_2(T)))
    if device == "tpu":
        if block % TPU_SUBLANES:
            raise TilingError(f"ModelConfig.{name} must be a multiple of {TPU_SUBLANES} on a TPU "
                             f"(Mosaic's (8, 128) tiles), got {block}")
        return min(block, -(-T // TPU_SUBLANES) * TPU_SUBLANES)
    return min(block, T)


def tiling(T: int, Dh: int, block_q: int, block_k: int, device: str) -> Tiling:
    """The tiles of a length-T attention on ``device`` ("gpu", "tpu" or "cpu");
    block_q / block_k of 0 take the device's default."""
    if device not in DEFAULT_BLOCKS:
        raise ValueError(f"the Pallas kernel's device must be one of {sorted(DEFAULT_BLOCKS)}, got {device!r}")
    default_q, default_k = DEFAULT_BLOCKS[device]
    Kq = _tile_side("pallas_block_q", block_q or default_q, T, device)
    Kk = _tile_side("pallas_block_k", block_k or default_k, T, device)
    Dp = max(MIN_GPU_TILE, pl.next_power_of_2(Dh)) if device == "gpu" else Dh
    return Tiling(T, Kq, Kk, -(-T // Kq), -(-T // Kk), Dh, Dp)


def plan(device: str, shape: pallas_tune.Shape, block_q: int, block_k: int, interpret=None,
         tuned: pallas_tune.Choice | None = None) -> tuple[Tiling, Launch]:
    """The tiles and launch of one branch. ``tuned`` given: it (the tuner's own timing
    runs). On a GPU with both blocks 0: the launch table's choice for ``shape`` when it
    has one (``tune.choice``: read only; None off a GPU or for an untuned shape).
    Otherwise the blocks given, 0 taking the device default. ``interpret`` None: True on
    "cpu" only."""
    launch_ = Launch(device, device == "cpu" if interpret is None else interpret)
    if tuned is None and device == "gpu" and not (block_q or block_k) and not launch_.interpret:
        tuned = pallas_tune.choice(shape)
    if tuned is not None:
        block_q, block_k = tuned.block_q, tuned.block_k
        launch_ = launch_._replace(num_warps=tuned.num_warps, num_stages=tuned.num_stages)
    return tiling(shape.T, shape.Dh, block_q, block_k, device), launch_
