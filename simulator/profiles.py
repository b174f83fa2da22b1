"""GPU and model-size tables, and the engine numbers derived from them.

Every speed in the simulator comes from here. The GPU figures are public spec-sheet numbers
(see docs/simulator.md for the sources); the derivation uses the usual roofline estimates:
prefill is compute bound, decode is memory-bandwidth bound.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from simulator.tokens import BLOCK_TOKENS

BYTES_PER_PARAM = 2  # BF16 weights and KV cache
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of GPU memory it may use
ACTIVATION_RESERVE_GB = 2.0  # per GPU: activations, CUDA graphs, NCCL buffers
PREFILL_MFU = 0.4  # achieved fraction of peak dense FLOPS during prefill
DECODE_MBU = 0.7  # achieved fraction of peak memory bandwidth during decode
STEP_OVERHEAD_MS = 1.5  # scheduler + kernel launch cost of one iteration
TP_EFFICIENCY = 0.85  # throughput kept per GPU once tensor parallel adds all-reduces
NOMINAL_CONTEXT_TOKENS = 1024  # context length whose KV a sequence reads per decode step
MAX_WEIGHT_SHARE = 0.85  # weights may use at most this share of usable memory
TP_CHOICES = (1, 2, 4, 8)
LORA_FIXED_MS = 25.0  # load from host cache, register, warm up
LORA_PARAM_SHARE = 0.005  # rank-16 all-linear adapter ≈ 0.5% of the base model's params


@dataclass(frozen=True)
class GpuSpec:
    """Public per-GPU figures (dense BF16/FP16 tensor FLOPS, no sparsity)."""

    name: str
    tflops: float
    mem_bw_tbps: float
    mem_gb: float
    pcie_gbps: float


@dataclass(frozen=True)
class ModelSize:
    """Architecture numbers of a representative model of this size (GQA, BF16)."""

    key: str
    params_b: float
    layers: int
    kv_heads: int
    head_dim: int
    max_model_len: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * BYTES_PER_PARAM

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * BYTES_PER_PARAM


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("h200", tflops=989.0, mem_bw_tbps=4.8, mem_gb=141.0, pcie_gbps=64.0),
        GpuSpec("h100", tflops=989.0, mem_bw_tbps=3.35, mem_gb=80.0, pcie_gbps=64.0),
        GpuSpec("a100", tflops=312.0, mem_bw_tbps=2.039, mem_gb=80.0, pcie_gbps=32.0),
        GpuSpec("l40s", tflops=362.0, mem_bw_tbps=0.864, mem_gb=48.0, pcie_gbps=32.0),
        GpuSpec("a10g", tflops=70.0, mem_bw_tbps=0.6, mem_gb=24.0, pcie_gbps=32.0),
        GpuSpec("l4", tflops=121.0, mem_bw_tbps=0.3, mem_gb=24.0, pcie_gbps=32.0),
    )
}

MODEL_SIZES: dict[str, ModelSize] = {
    m.key: m
    for m in (
        # Llama-3.2-1B / 3B, Llama-3.1-8B, Qwen2.5-14B, Qwen2.5/Qwen3-32B, Llama-3.1-70B
        ModelSize("1b", params_b=1.24, layers=16, kv_heads=8, head_dim=64, max_model_len=8192),
        ModelSize("3b", params_b=3.21, layers=28, kv_heads=8, head_dim=128, max_model_len=8192),
        ModelSize("8b", params_b=8.03, layers=32, kv_heads=8, head_dim=128, max_model_len=8192),
        ModelSize("14b", params_b=14.8, layers=48, kv_heads=8, head_dim=128, max_model_len=8192),
        ModelSize("32b", params_b=32.8, layers=64, kv_heads=8, head_dim=128, max_model_len=8192),
        ModelSize("70b", params_b=70.6, layers=80, kv_heads=8, head_dim=128, max_model_len=8192),
    )
}
DEFAULT_MODEL_SIZE = "8b"

_SIZE_RE = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)\s*b(?![a-z])")


@dataclass(frozen=True)
class EngineProfile:
    """The numbers the engine runs on; any of them can be overridden per pod."""

    gpu: str
    model_size: str
    tensor_parallel: int
    prefill_tokens_per_s: float
    base_step_ms: float
    per_seq_ms: float
    num_gpu_blocks: int
    block_size: int
    lora_load_ms: float
    max_model_len: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def step_s(self, batch: int) -> float:
        return (self.base_step_ms + self.per_seq_ms * batch) / 1000.0


OVERRIDABLE = frozenset(
    {"prefill_tokens_per_s", "base_step_ms", "per_seq_ms", "num_gpu_blocks", "lora_load_ms",
     "max_model_len"}
)


def infer_model_size(model_name: str) -> str:
    """Map "llama-3.1-8b-instruct" / "qwen3-32b" to the nearest size key (log scale)."""
    matches = _SIZE_RE.findall(model_name.lower())
    if not matches:
        return DEFAULT_MODEL_SIZE
    billions = float(matches[-1])
    if billions <= 0:
        return DEFAULT_MODEL_SIZE
    return min(MODEL_SIZES.values(), key=lambda m: abs(math.log(m.params_b / billions))).key


def _usable_gb(gpu: GpuSpec, tp: int) -> float:
    return tp * (gpu.mem_gb * GPU_MEMORY_UTILIZATION - ACTIVATION_RESERVE_GB)


def choose_tensor_parallel(gpu: GpuSpec, size: ModelSize) -> int:
    """Smallest TP degree whose GPUs hold the weights with room left for a useful KV cache.

    When no degree leaves that much room (70B on A10G), the smallest one that fits at all.
    """
    weights_gb = size.weight_bytes / 1e9
    for share in (MAX_WEIGHT_SHARE, 1.0):
        for tp in TP_CHOICES:
            if weights_gb < share * _usable_gb(gpu, tp):
                return tp
    raise ValueError(f"model size {size.key} does not fit on {TP_CHOICES[-1]}x {gpu.name}")


def build_profile(
    gpu: str,
    model: str,
    *,
    model_size: str | None = None,
    tensor_parallel: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> EngineProfile:
    """Derive prefill rate, decode step cost and KV capacity for one pod."""
    if gpu not in GPUS:
        raise ValueError(f"unknown gpu {gpu!r}; known: {', '.join(GPUS)}")
    size_key = model_size or infer_model_size(model)
    if size_key not in MODEL_SIZES:
        raise ValueError(f"unknown model_size {size_key!r}; known: {', '.join(MODEL_SIZES)}")
    spec, size = GPUS[gpu], MODEL_SIZES[size_key]
    tp = tensor_parallel or choose_tensor_parallel(spec, size)
    efficiency = 1.0 if tp == 1 else TP_EFFICIENCY
    flops = spec.tflops * 1e12 * tp * efficiency
    bandwidth = spec.mem_bw_tbps * 1e12 * tp * efficiency * DECODE_MBU
    kv_bytes_free = _usable_gb(spec, tp) * 1e9 - size.weight_bytes
    if kv_bytes_free <= 0:
        raise ValueError(f"model size {size.key} does not fit on {tp}x {gpu}")
    per_token_flops = 2 * size.params_b * 1e9
    kv_read_s = NOMINAL_CONTEXT_TOKENS * size.kv_bytes_per_token / bandwidth
    adapter_bytes = size.weight_bytes * LORA_PARAM_SHARE
    num_blocks = int(kv_bytes_free // size.kv_bytes_per_token) // BLOCK_TOKENS
    profile = EngineProfile(
        gpu=gpu,
        model_size=size.key,
        tensor_parallel=tp,
        prefill_tokens_per_s=round(flops * PREFILL_MFU / per_token_flops, 1),
        base_step_ms=round(STEP_OVERHEAD_MS + 1000 * size.weight_bytes / bandwidth, 3),
        per_seq_ms=round(1000 * (kv_read_s + per_token_flops / (flops * PREFILL_MFU)), 4),
        num_gpu_blocks=num_blocks,
        block_size=BLOCK_TOKENS,
        lora_load_ms=round(LORA_FIXED_MS + 1000 * adapter_bytes / (spec.pcie_gbps * 1e9), 2),
        max_model_len=min(size.max_model_len, num_blocks * BLOCK_TOKENS),
    )
    return apply_overrides(profile, overrides or {})


def apply_overrides(profile: EngineProfile, overrides: dict[str, Any]) -> EngineProfile:
    unknown = set(overrides) - OVERRIDABLE
    if unknown:
        raise ValueError(f"unknown profile field(s): {', '.join(sorted(unknown))}")
    for key, value in overrides.items():
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"profile.{key} must be a positive number")
    fields = dict(overrides)
    if "num_gpu_blocks" in fields:
        fields["num_gpu_blocks"] = int(fields["num_gpu_blocks"])
    if "max_model_len" in fields:
        fields["max_model_len"] = int(fields["max_model_len"])
    profile = replace(profile, **fields)
    cap = profile.num_gpu_blocks * profile.block_size
    if profile.max_model_len > cap:
        profile = replace(profile, max_model_len=cap)
    return profile
