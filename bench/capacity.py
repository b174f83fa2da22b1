"""How many requests per second a simulated pod sustains, from its engine profile.

The simulator's iteration (docs/simulator.md, "Engine model") takes
`base + per_seq × B + prefill tokens / prefill_tps` for a batch of B running sequences.
At a steady arrival rate λ (requests per model second) with mean uncached prompt P and
mean output O tokens:

- prefill tokens admitted per iteration = λ × s × P, where s is the iteration time;
- by Little's law the batch is B = λ × O × s (each request stays for O iterations);

so s = base + per_seq × λ O s + λ s P / prefill_tps, i.e. s = base / (1 − λ c) with
c = P / prefill_tps + per_seq × O (the engine time one request costs beyond the fixed
step). The batch is bounded by `max_num_seqs` and by what the KV cache holds
(B × (P_total + O/2) tokens, P_total being the whole prompt), so
B = λ O base / (1 − λ c) ≤ B_max gives the largest sustainable rate

    λ_max = B_max / (O × base + B_max × c).

That is the pod's capacity at 100 % utilization (queues grow without bound at or beyond
it). A scenario's load is a utilization target times a fleet capacity; for round-robin the
fleet capacity is `pods × min(pod capacity)`, since round-robin gives every pod the same
share and the slowest pod saturates first.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulator.profiles import build_profile

DEFAULT_MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class Workload:
    """Mean request shape: tokens to prefill (uncached), whole prompt, output."""

    prefill_tokens: float
    prompt_tokens: float
    output_tokens: float


def pod_capacity(
    gpu: str,
    model: str,
    work: Workload,
    *,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    model_size: str | None = None,
    tensor_parallel: int | None = None,
) -> float:
    """Requests per model second one pod sustains at 100 % utilization."""
    prof = build_profile(gpu, model, model_size=model_size, tensor_parallel=tensor_parallel)
    base = prof.base_step_ms / 1000.0
    per_seq = prof.per_seq_ms / 1000.0
    c = work.prefill_tokens / prof.prefill_tokens_per_s + per_seq * work.output_tokens
    kv_tokens = prof.num_gpu_blocks * prof.block_size
    b_max = min(float(max_num_seqs), kv_tokens / (work.prompt_tokens + work.output_tokens / 2))
    return b_max / (work.output_tokens * base + b_max * c)


def round_robin_capacity(capacities: list[float]) -> float:
    """Fleet rate at which round-robin saturates its slowest pod."""
    return len(capacities) * min(capacities)


def total_capacity(capacities: list[float]) -> float:
    return sum(capacities)
