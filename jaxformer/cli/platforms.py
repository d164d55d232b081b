"""The platform JAX starts on when the command line names none: on a machine with neither a
TPU nor a GPU, the CPU, chosen before libtpu (installed with the dev extra) can look for a TPU
and print its TPU_WORKER_HOSTNAMES error block. ``jaxformer`` calls it before any command."""

from __future__ import annotations

import glob
import importlib.util
import os

import jax

GOOGLE_PCI_VENDOR = "0x1ae0"  # a TPU chip's PCI vendor id
GPU_DEVICES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")  # an NVIDIA or an AMD GPU


def cpu_only_without_tpu_probe() -> bool:
    """On a machine with neither a TPU nor a GPU, with libtpu installed (the dev extra) and
    no platform chosen (JAX_PLATFORMS unset): choose the CPU before JAX starts a backend, so
    libtpu does not look for a TPU and print its TPU_WORKER_HOSTNAMES error block. Whether
    it chose; a no-op once JAX has started its backends."""
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or importlib.util.find_spec("libtpu") is None:
        return False
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() == GOOGLE_PCI_VENDOR:
                    return False
        except OSError:
            continue
    if any(os.path.exists(d) for d in GPU_DEVICES) or glob.glob("/dev/accel*"):  # a TPU VM's chips
        return False
    jax.config.update("jax_platforms", "cpu")
    return True
