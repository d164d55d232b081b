"""Model FLOPs per token, device peaks and MFU (model FLOPs utilization).

The convention (docs/design.md, "FLOPs and MFU"), per token of a training step
(forward + backward, the backward counted as twice the forward):

    6 * N                      N = matmul parameters: L * (4 D^2 + 2 D F) + D V
                               (q, k, v, o projections, the feed-forward's two
                               weights, the head; no biases, layer norms or
                               embeddings: the embedding is a gather, not a matmul;
                               k and v are Hkv Dh wide with grouped-query attention,
                               q and o H Dh wide where head_dim sets Dh apart from
                               D / H, and the gated MLP has 3 D F weights)
  + 12 * L * T * D             (H Dh where head_dim is set) attention scores q k^T and the weighted sum P v,
                               forward 2 matmuls * 2 FLOPs * T * D, times 3
  / 2 when causal              a causal model uses only the lower triangle of
                               the scores, so half of the attention term counts

A mixture of experts (n_experts E > 0) counts the weights a token goes through, its
active parameters: each layer's 2 D F (3 D F gated) becomes the router's D E, the k
chosen experts' k * 3 D F_e, and with a shared expert its 3 D Fs and its gate's D; the
other E - k experts hold parameters but do no work for the token (``active=False``
counts all E, for reports). The MFU of an MoE model is then its active-parameter MFU.

A LoRA run (``lora``: its LoraConfig) trains adapters over frozen weights, and its step
computes no gradient of a frozen weight: per token it does the forward's 2 N, the
backward's dX through every frozen weight, another 2 N, but no dW (2 N); the adapters'
products (x A, then B) cost 2 r (I + O) per adapted I x O projection forward and twice
that backward (dA, dB and dX through both), so 6 per adapter parameter:

    4 * N + 6 * N_lora + the attention term      N_lora = L * r * (I + O) per adapted weight

MFU = achieved model FLOP/s / the device's peak FLOP/s, where achieved =
tokens/s * FLOPs per token. The masked half of a causal attention that the
"full" implementation still computes is not counted: MFU measures useful work.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxformer.model.checks import check_int
from jaxformer.model.config import ModelConfig
from jaxformer.model.lora import sites
from jaxformer.model.params import init_params

CONVENTION = (
    "training FLOPs per token = 6*N + 12*L*T*D (attention), the attention term halved when "
    "causal; N = matmul params L*(4*D^2 + 2*D*F) + D*V (no biases, norms or embedding gather); "
    "a mixture of experts counts its active params: the router D*E, k experts' 3*D*F_e, "
    "a shared expert's 3*D*Fs + D, in place of 2*D*F; a LoRA step (no dW of frozen weights) "
    "counts 4*N + 6*N_lora, N_lora = L*r*(I + O) per adapted weight, in place of 6*N"
)

TFLOP = 1e12
PEAK_FILE = "peak.json"
# No CPU core today does 1 TFLOP/s of float32 (a Zen 4 or Sapphire Rapids core with two
# 512-bit FMA units at 4 GHz does ~0.26): a faster "measurement" timed something other
# than the matmul, and is neither cached nor used.
CPU_CORE_CEILING = 1e12

# Dense (no structured sparsity) peak FLOP/s per accelerator and matmul dtype, from
# NVIDIA's datasheets, which quote bf16/tf32 "with sparsity": the dense figure is half.
#   H100 / H200 SXM: NVIDIA H100 Tensor Core GPU datasheet and NVIDIA H200 product page
#     (https://www.nvidia.com/en-us/data-center/h100/, https://www.nvidia.com/en-us/data-center/h200/):
#     BF16 1979 TFLOP/s sparse -> 989.4 dense, TF32 989 sparse -> 494.7 dense, FP32 67.
#   H100 PCIe: same datasheet: BF16 1513 sparse -> 756, TF32 756 sparse -> 378, FP32 51.
#   H100 NVL / H200 NVL: the same pages: BF16 1671 sparse -> 835.5, TF32 835 sparse -> 417.5.
#   GH200: the H100-class GPU of Grace Hopper, the SXM figures.
#   A100 SXM/PCIe: NVIDIA A100 Tensor Core GPU datasheet
#     (https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
#      nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): BF16 312, TF32 156, FP32 19.5.
# float32 matmuls map to tf32: XLA's default matmul precision on these GPUs uses TF32.
# Keys are matched against jax.Device.device_kind, first match wins (PCIe before SXM).
# jax reports e.g. "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe", "NVIDIA H200".
KNOWN_PEAKS = (
    ("H100 PCIe", {"bfloat16": 756e12, "float16": 756e12, "float32": 378e12}),
    ("H100 NVL", {"bfloat16": 835.5e12, "float16": 835.5e12, "float32": 417.5e12}),
    ("H200 NVL", {"bfloat16": 835.5e12, "float16": 835.5e12, "float32": 417.5e12}),
    ("GH200", {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12}),
    ("H100", {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12}),
    ("H200", {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12}),
    ("A100", {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12}),
)
# Non-tensor-core FP32 peaks (the same datasheets), for reference in reports.
FP32_NON_TENSOR = {"H100 PCIe": 51.2e12, "H100 NVL": 60e12, "H200 NVL": 60e12, "GH200": 66.9e12,
                   "H100": 66.9e12, "H200": 66.9e12, "A100": 19.5e12}


def ffn_matmul_params(config: ModelConfig, active: bool = True) -> int:
    """One layer's feed-forward weights that a token's matmuls use: 2 D F, 3 D F gated; a
    mixture of experts: the router D E, k experts' 3 D F_e (all E with ``active`` False), a
    shared expert's 3 D Fs and its sigmoid gate's D."""
    D = config.d_model
    if not config.n_experts:
        return (3 if config.mlp == "gated" else 2) * D * config.d_ff
    experts = config.experts_per_token if active else config.n_experts
    shared = 3 * D * config.shared_expert_d_ff + (D if config.shared_expert_d_ff and config.shared_expert_gate else 0)
    return D * config.n_experts + experts * 3 * D * config.expert_width + shared


def matmul_params(config: ModelConfig, active: bool = True) -> int:
    """N: weights that take part in a token's matmuls (q, k, v, o, the feed-forward's per
    layer; the head). Grouped-query attention narrows k and v to Hkv * Dh columns; the gated
    MLP has three weights (w_gate, w_up, w_down) where the plain one has two; an MoE layer
    counts its k active experts (ffn_matmul_params; ``active`` False: all E)."""
    D, L, V = config.d_model, config.n_layers, config.vocab_size
    q, kv = config.n_heads * config.d_head, config.kv_heads * config.d_head  # D, D unless head_dim or GQA
    return L * (2 * D * q + 2 * D * kv + ffn_matmul_params(config, active)) + D * V


def attention_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """12 * L * T * H Dh for a bidirectional model (H Dh = D unless head_dim sets Dh), half
    that when causal."""
    full = 12 * config.n_layers * seq_len * config.n_heads * config.d_head
    return full // 2 if config.causal else full


def adapter_params(config: ModelConfig, lora) -> int:
    """N_lora: the parameters of the adapters ``lora`` (a LoraConfig) puts on ``config``'s
    projections, L * r * (I + O) per adapted (L, I, O) weight (model/lora.py's sites: the
    named projections the model has; an MoE layer's experts take none)."""
    shapes = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config))
    return sum(L * lora.rank * (I + O) for L, I, O in
               (shapes["blocks"][group][name].shape for group, name in sites(shapes, lora)))


def flops_per_token(config: ModelConfig, seq_len: int, lora=None) -> int:
    """Training (forward + backward) model FLOPs per token; see the module docstring.
    ``lora``: a LoRA run's LoraConfig (4 N + 6 N_lora in place of 6 N)."""
    check_int("seq_len", seq_len)
    n = matmul_params(config)
    dense = 6 * n if lora is None else 4 * n + 6 * adapter_params(config, lora)
    return dense + attention_flops_per_token(config, seq_len)


def flops_breakdown(config: ModelConfig, seq_len: int, lora=None) -> dict:
    """The terms of flops_per_token, for reports."""
    moe = {"matmul_params_all_experts": matmul_params(config, active=False)} if config.n_experts else {}
    n = matmul_params(config)
    dense = ({"dense_6N": 6 * n} if lora is None else
             {"adapter_params": adapter_params(config, lora), "lora_4N": 4 * n,
              "adapters_6N_lora": 6 * adapter_params(config, lora)})
    return {
        "matmul_params": n,
        **moe,
        **dense,
        "attention": attention_flops_per_token(config, seq_len),
        "per_token": flops_per_token(config, seq_len, lora),
        "convention": CONVENTION,
    }


def matmul_dtype(config: ModelConfig, param_dtype="float32") -> str:
    """The dtype matmuls run in: compute_dtype when set, else the params' dtype."""
    return config.compute_dtype or jnp.dtype(param_dtype).name


def cpu_key(n: int) -> str:
    """The key of this machine's CPU peak: CPU model, core count, matmul size."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} | {os.cpu_count()} cores | float32 {n}x{n} matmul"


def peak_cache_path() -> Path:
    """$XDG_CACHE_HOME/jaxformer/peak.json (default ~/.cache/jaxformer/peak.json)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "jaxformer" / PEAK_FILE


def plausible_cpu_peak(flop_s) -> bool:
    """A CPU peak figure that could be true: positive and under CPU_CORE_CEILING per core."""
    return (isinstance(flop_s, (int, float)) and
            0 < flop_s < CPU_CORE_CEILING * (os.cpu_count() or 1))


@functools.lru_cache(maxsize=4)
def measure_cpu_peak(n: int = 1024, reps: int = 10) -> float | None:
    """This machine's CPU peak FLOP/s (cpu_matmul_flops), measured once per machine:
    cached in peak_cache_path() under cpu_key(n), so every run's MFU divides by the
    same figure. A busy machine measures too low a peak (MFU over 100% follows), so a
    figure measured while the load average exceeds half the cores is used for this
    process only and not cached. An unreadable or unwritable cache only costs a measurement.
    A figure no CPU could reach (plausible_cpu_peak), cached or measured, is dropped: the
    matmul is measured again, and if it is still implausible the peak is None (MFU n/a)."""
    path, key = peak_cache_path(), cpu_key(n)
    cached = _peak_cache()
    if plausible_cpu_peak(cached.get(key)):
        return float(cached[key])
    peak = cpu_matmul_flops(n, reps)
    if not plausible_cpu_peak(peak):
        peak = cpu_matmul_flops(n, reps)
        if not plausible_cpu_peak(peak):
            return None
    if machine_is_busy():
        return peak
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**cached, key: peak}, indent=1))
        tmp.replace(path)  # atomic: another process never reads half a file
    except OSError:
        pass
    return peak


def _peak_cache() -> dict:
    """The peaks peak_cache_path() holds ({} when it is missing, unreadable or not a table)."""
    try:
        cached = json.loads(peak_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def cached_cpu_peak(n: int = 1024) -> float | None:
    """The figure peak_cache_path() holds for this machine's (n, n) matmul, None when none."""
    return _peak_cache().get(cpu_key(n))


def machine_is_busy() -> bool:
    """The 1-minute load average exceeds half the cores: timings now are others' too."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1) / 2
    except OSError:  # no load average on this platform
        return False


def cpu_matmul_flops(n: int = 1024, reps: int = 10) -> float:
    """FLOP/s of the median of ``reps`` jitted float32 (n, n) @ (n, n) matmuls on the CPU,
    now (the median: one odd timing, fast or slow, does not become the peak)."""
    cpu = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), cpu)
    b = jax.device_put(jnp.full((n, n), 0.5, jnp.float32), cpu)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()  # compile
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        matmul(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / statistics.median(times)


def device_peak(device=None, dtype: str = "float32", *, cpu_matmul: int = 1024) -> tuple[float | None, str]:
    """(peak FLOP/s, where it comes from) for ``device`` (default: the first JAX device).
    Known accelerators use the table above; a CPU measures a float32 matmul;
    anything else gives (None, reason). A CPU's figure is measured once per machine
    (measure_cpu_peak's cache); one measured on a busy machine is this process's own,
    and the reason says so."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        peak = measure_cpu_peak(cpu_matmul)
        if peak is None:
            return None, (f"a {cpu_matmul}x{cpu_matmul} float32 matmul timed faster than any "
                          f"CPU can run it, twice; no peak to divide by")
        if cached_cpu_peak(cpu_matmul) == peak:
            return peak, (f"measured once on this machine: median float32 "
                          f"{cpu_matmul}x{cpu_matmul} matmul, cached in {peak_cache_path()}")
        return peak, (f"measured by this process, median float32 {cpu_matmul}x{cpu_matmul} matmul; "
                      f"not cached, as the machine was busy (or {peak_cache_path()} is not "
                      f"writable): a rough figure")
    kind = getattr(device, "device_kind", "")
    for key, peaks in KNOWN_PEAKS:
        if key in kind:
            if dtype in peaks:
                return peaks[dtype], f"{key} dense {dtype} datasheet figure"
            return None, f"no {dtype} peak known for {kind}"
    return None, f"no peak known for {kind or device.platform}"


def mfu(tokens_per_s: float, config: ModelConfig, seq_len: int, device=None,
        param_dtype="float32", n_devices: int = 1, lora=None) -> float | None:
    """Model FLOPs utilization of a training run at ``tokens_per_s`` (all devices
    together) on ``n_devices`` devices like ``device`` (default: the first JAX device);
    None when the device's peak is unknown. ``lora``: a LoRA run's LoraConfig."""
    peak, _ = device_peak(device, matmul_dtype(config, param_dtype))
    if not peak:
        return None
    return tokens_per_s * flops_per_token(config, seq_len, lora) / (peak * n_devices)


def mfu_text(tokens_per_s: float, config: ModelConfig, seq_len: int, device=None,
             param_dtype="float32", n_devices: int = 1, lora=None) -> str:
    """mfu() as a percentage for a log line, "n/a" when the peak is unknown."""
    value = mfu(tokens_per_s, config, seq_len, device, param_dtype, n_devices, lora)
    return "n/a" if value is None else f"{100 * value:.1f}%"
