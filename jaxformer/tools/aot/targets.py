"""The devices ``aot.compile_for`` compiles for without having them: a TPU v5e from
libtpu's topology (jax[tpu]), an H100 from JAX's CUDA plugin and a GPU target config
(jax[cuda12]; deviceless: no GPU is opened, the device is the description below).

Both are compile-only devices: XLA's compiler for the real chip runs here, and
``memory_analysis()`` reads its memory plan, but nothing can execute and a device's
``memory_stats()`` is refused ("only supported for addressable devices"). So the memory
each target is judged against (``Target.hbm_bytes``) is the compiler's own figure where
it states one (libtpu refuses a program over 15.75 GiB of a v5e's 16 GiB with
RESOURCE_EXHAUSTED, which ``aot.compile_for`` reports as "too big"), else the published
capacity (the H100's 80 GB, as nvidia-smi counts it).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import re
from typing import NamedTuple

import jax
from jax.experimental import topologies

from jaxformer.tools.aot.plugin import CUDNN_LIBRARY

GiB = 2**30


class Target(NamedTuple):
    name: str  # "tpu-v5e", "h100"
    platform: str  # the platform its programs are lowered for: "tpu" | "cuda"
    label: str  # the device, in words
    hbm_bytes: int  # one device's memory a program may use


TARGETS = {
    # TPU v5e (v5 lite): 16 GiB of HBM2 per chip, of which libtpu gives a program 15.75 GiB
    # (its out-of-memory error: "exceeds available HBM (15.75G)"); v5e:2x2 is four chips.
    "tpu-v5e": Target("tpu-v5e", "tpu", "TPU v5e (16 GiB HBM)", int(15.75 * GiB)),
    # H100 SXM 80GB: 81559 MiB, the total nvidia-smi reports (a JAX process preallocates
    # 75% of it by default: XLA_PYTHON_CLIENT_MEM_FRACTION); the label is its device kind.
    "h100": Target("h100", "cuda", "NVIDIA H100 80GB HBM3", 81559 * 2**20),
}

TPU_TOPOLOGY = "v5e:2x2"
# the v5e slices libtpu's topology makes, by chip count (v5litepod-4 ... -256); fewer than four
# chips are the first of TPU_TOPOLOGY's (a one-chip program is compiled the same)
TPU_SLICES = {4: "v5e:2x2", 8: "v5e:2x4", 16: "v5e:4x4", 32: "v5e:4x8", 64: "v5e:8x8", 128: "v5e:8x16",
              256: "v5e:16x16"}

# stream_executor.GpuTargetConfigProto (text) of an H100 SXM5 80GB: compute capability 9.0,
# 132 SMs, 228 KiB shared memory per SM (227 KiB per block opt-in), 50 MiB L2, 3.35 TB/s,
# 1.98 GHz boost; cuDNN 9.8, the oldest the CUDA 12 plugin takes.
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 85520809984
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def cuda_plugin() -> str | None:
    """The installed JAX CUDA plugin's module name, or None. JAX traces cuDNN attention
    only with it (it asks the plugin for cuDNN's version) and compiles for a GPU with it."""
    return next((name for name in CUDA_PLUGINS if importlib.util.find_spec(name) is not None), None)


def load_cudnn() -> None:
    """Load the cuDNN library of the ``nvidia-cudnn-cu12`` package where one is on the path, as
    JAX's CUDA plugin does when it starts a GPU backend. A CPU process that compiles for an H100
    never starts one, and JAX reads cuDNN's version while tracing cuDNN's attention."""
    try:
        package = importlib.util.find_spec("nvidia.cudnn")
    except ImportError:  # no nvidia package at all
        return
    for folder in package.submodule_search_locations if package else ():
        try:
            ctypes.cdll.LoadLibrary(os.path.join(folder, CUDNN_LIBRARY))
            return
        except OSError:
            continue


def cudnn_problem() -> str | None:
    """Why JAX cannot trace cuDNN's attention here (one line), or None. It reads cuDNN's
    version through the CUDA plugin, which needs the plugin (jax-cuda12-plugin) and the
    cuDNN library beside it (nvidia-cudnn-cu12; jax[cuda12] installs both;
    ``python -m jaxformer.tools.aot.plugin`` puts both in a folder of their own)."""
    plugin = cuda_plugin()
    if plugin is None:
        return "JAX's CUDA plugin is not installed (pip install 'jaxformer[cuda]')"
    load_cudnn()
    try:
        importlib.import_module(f"{plugin}._versions").cudnn_get_version()
    except Exception as error:  # noqa: BLE001 - the plugin's own words: "cuDNN not found."
        return (f"the cuDNN library is not installed ({str(error).strip()} pip install nvidia-cudnn-cu12, "
                f"or 'jaxformer[cuda]'); JAX's CUDA plugin alone compiles the rest")
    return None


def missing(target: Target) -> str | None:
    """Why ``target`` cannot be compiled for here (one line), or None."""
    if target.platform == "tpu" and importlib.util.find_spec("libtpu") is None:
        return "libtpu is not installed (pip install 'jaxformer[tpu]'): no TPU compiler here"
    if target.platform == "cuda" and cuda_plugin() is None:
        return "JAX's CUDA plugin is not installed (pip install 'jaxformer[cuda]'): no GPU compiler here"
    return None


def tpu_topology(count: int) -> str:
    """libtpu's topology name for ``count`` v5e chips: TPU_TOPOLOGY up to its four, else the
    slice of exactly that many (TPU_SLICES); ValueError naming the counts there are."""
    if count <= 4:
        return TPU_TOPOLOGY
    if count not in TPU_SLICES:
        raise ValueError(f"a TPU v5e slice has {', '.join(map(str, TPU_SLICES))} chips (or one chip), "
                         f"not {count}")
    return TPU_SLICES[count]


def target_devices(target: Target, count: int = 1) -> list:
    """``count`` compile-only devices of ``target``. The TPU's come from libtpu's topology
    (loaded here, with its cloud metadata queries off): ``tpu_topology(count)``'s; run with
    JAX_PLATFORMS=cpu so that JAX does not also look for a TPU to run on."""
    reason = missing(target)
    if reason:
        raise RuntimeError(reason)
    if target.platform == "tpu":
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no cloud metadata server here
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        devices = topologies.get_topology_desc(platform="tpu", topology_name=tpu_topology(count)).devices
    else:
        devices = topologies.get_topology_desc(
            target.name, "cuda", target_config=H100_TARGET_CONFIG, topology=f"1x1x{count}").devices
    if len(devices) < count:
        raise ValueError(f"{target.label}: the topology has {len(devices)} devices, {count} are needed")
    return list(devices[:count])


def abstract_device(target: Target):
    """``target``'s device as JAX's abstract meshes name one (its kind, platform and cores), for
    lowering without it; None for a TPU target, or where JAX has no abstract devices."""
    if target.platform != "cuda" or not hasattr(jax.sharding, "AbstractDevice"):
        return None
    cores = int(re.search(r"core_count: (\d+)", H100_TARGET_CONFIG).group(1))
    return jax.sharding.AbstractDevice(device_kind=target.label, platform="gpu", num_cores=cores)


def compiling_for(target: Target):
    """A context in which JAX lowers for ``target``. JAX 0.11's Pallas GPU lowering reads the
    GPU it compiles Triton for from the abstract mesh's device, no longer from the device in
    use (this machine's CPU): for a GPU target the context names the target's device there,
    on an empty mesh (a step's own mesh names it too: ``steps.build``). Elsewhere, and where
    JAX has no abstract devices, nothing."""
    if target.platform == "cuda":
        load_cudnn()  # cuDNN's attention reads the library's version while tracing
    device = abstract_device(target)
    if device is None:
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device))
