"""The benchmark scenarios: a simulated fleet, an arrival process and request shapes each.

Each scenario models one row of the published results (gateway vs Kubernetes
round-robin) with the realistic traffic that row describes, not a traffic shape picked to
flatter a router. Load is calibrated from the simulator's own GPU profiles
(bench/capacity.py): a pod's capacity is the request rate at which its engine would be
100 % busy; round-robin gives every pod the same share, so the fleet saturates under
round-robin at `pods × slowest pod's capacity`, and each scenario's mean load is a
utilization target of that (round-robin near, but not past, saturation on average).

Request lengths follow the heavy-tailed shape of production chat traces (ShareGPT-like):
log-normal prompt and output lengths, clipped. Every request is a streamed chat
completion; the simulator generates exactly `max_tokens` tokens.

`time_scale` compresses model time (the simulator's engine runs that many times faster
than the wall clock; every router sees the same scale; all reported latencies are model
seconds). It is chosen per scenario so the wall-clock request rate stays within what this
2-core machine drives without the simulator, the load generator or the router process
being starved (checked per run: CPU per process and send lateness are in the report).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.capacity import Workload, pod_capacity, round_robin_capacity, total_capacity
from bench.workload import (
    Corpus,
    RequestSpec,
    chat_body,
    chat_prompt_tokens,
    lognormal,
    lognormal_mean,
    on_off_arrivals,
    poisson_arrivals,
)

# ShareGPT-like chat: median prompt 400 tokens, median output 150, heavy tails.
CHAT_PROMPT = (400.0, 0.9, 16, 4096)
CHAT_OUTPUT = (150.0, 0.7, 8, 512)


@dataclass(frozen=True)
class PoolPlan:
    """One model pool: its pods and the load it gets."""

    model: str
    pods: list[dict[str, Any]]
    rate: float  # mean requests per model second
    capacities: list[float]  # per pod, requests per model second at 100 %

    @property
    def rr_capacity(self) -> float:
        return round_robin_capacity(self.capacities)

    @property
    def total_capacity(self) -> float:
        return total_capacity(self.capacities)


@dataclass
class Plan:
    """Everything a scenario run needs: fleet, scale, requests, and how load was set."""

    scenario: str
    pools: list[PoolPlan]
    time_scale: float
    duration_s: float  # model seconds of arrivals
    requests: list[RequestSpec]
    calibration: dict[str, Any] = field(default_factory=dict)

    @property
    def pods(self) -> list[dict[str, Any]]:
        return [p for pool in self.pools for p in pool.pods]

    @property
    def wall_duration_s(self) -> float:
        return self.duration_s / self.time_scale


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    rows: tuple[str, ...]  # published rows this scenario models
    description: str  # fleet, arrivals, lengths, and why it models the row
    time_scale: float
    wall_duration_s: float  # default arrivals window per router run, wall seconds
    build: Callable[[int, float, float], Plan]  # (seed, model duration, time_scale)
    # How many times its default model seconds a comparison of configurations runs
    # (`igw bench --replicas`, `--twin-replicas`): their p95s are compared within 10 %, so
    # one tail request more or less must not move the p95 (`plan(..., comparison=True)`).
    comparison_span: float = 1.0

    def plan(self, seed: int, wall_duration_s: float | None = None,
             time_scale: float | None = None, *, comparison: bool = False) -> Plan:
        """Another time scale alone keeps the model seconds, so the arrivals are the same
        ones, run slower or faster (at 1, a data path that costs wall time counts once)."""
        scale = time_scale or self.time_scale
        span = self.comparison_span if comparison else 1.0
        wall = wall_duration_s or span * self.wall_duration_s * self.time_scale / scale
        return self.build(seed, wall * scale, scale)


def make_pods(gpu: str, model: str, n: int, prefix: str, **extra: Any) -> list[dict[str, Any]]:
    """n pod entries of the fleet spec (simulator/spec.py), named `prefix-gpu-i`."""
    return [{"name": f"{prefix}-{gpu}-{i}", "gpu": gpu, "model": model, **extra}
            for i in range(n)]


def _chat_lengths(rng: random.Random) -> tuple[int, int]:
    return lognormal(rng, *CHAT_PROMPT), lognormal(rng, *CHAT_OUTPUT)


CHAT_WORK = Workload(
    prefill_tokens=lognormal_mean(*CHAT_PROMPT[:2]),
    prompt_tokens=lognormal_mean(*CHAT_PROMPT[:2]),
    output_tokens=lognormal_mean(*CHAT_OUTPUT[:2]),
)


def capacities(pods: list[dict[str, Any]], work: Workload) -> list[float]:
    """Each pod's capacity (requests per model second at 100 %) for the mean request."""
    return [
        pod_capacity(p["gpu"], p["model"], work, max_num_seqs=p.get("max_num_seqs", 256))
        for p in pods
    ]


def chat_request(index: int, at: float, model: str, pool: str, user: str, output: int,
                 group: str, system: str | None = None) -> RequestSpec:
    """One streamed chat request (`model` may name an adapter of `pool`'s base model)."""
    return RequestSpec(
        index=index, at=at, model=model, pool=pool,
        body=chat_body(model, user, output, system=system),
        prompt_tokens=chat_prompt_tokens(user, system), max_tokens=output, group=group,
        shared_prefix_tokens=len(f"<|system|>\n{system}\n") // 4 if system is not None else 0,
    )


def _chat_requests(
    rng: random.Random, corpus: Corpus, times: list[tuple[float, str]], start_index: int = 0
) -> list[RequestSpec]:
    out = []
    for i, (t, model) in enumerate(sorted(times)):
        prompt, output = _chat_lengths(rng)
        user = corpus.text_of(prompt)
        out.append(chat_request(start_index + i, t, model, model, user, output, model))
    return out


def calibration(pools: list[PoolPlan], utilization: float, **extra: Any) -> dict[str, Any]:
    """How a plan's load was set, per pool, for its report."""
    return {
        "utilization_target_of_rr_capacity": utilization,
        "pools": {
            p.model: {
                "pods": [f"{q['gpu']}" for q in p.pods],
                "pod_capacity_rps": [round(c, 2) for c in p.capacities],
                "rr_capacity_rps": round(p.rr_capacity, 2),
                "total_capacity_rps": round(p.total_capacity, 2),
                "mean_rate_rps": round(p.rate, 2),
                "share_of_total_capacity": round(p.rate / p.total_capacity, 3),
            }
            for p in pools
        },
        **extra,
    }


# ----- mixed ------------------------------------------------------------------------------

MIXED_UTILIZATION = 0.85


def build_mixed(seed: int, duration: float, time_scale: float) -> Plan:
    rng = random.Random(f"mixed:{seed}")
    corpus = Corpus(rng)
    pools = []
    for model, layout in (
        ("llama-3.1-8b", (("h100", 2), ("a10g", 4))),
        ("qwen3-32b", (("h100", 2), ("a10g", 2))),
    ):
        short = model.split("-")[-1]
        pods = [p for gpu, n in layout for p in make_pods(gpu, model, n, short)]
        caps = capacities(pods, CHAT_WORK)
        pools.append(PoolPlan(model, pods, MIXED_UTILIZATION * round_robin_capacity(caps), caps))
    times = [(t, p.model) for p in pools for t in poisson_arrivals(rng, p.rate, 0.0, duration)]
    return Plan("mixed", pools, time_scale, duration, _chat_requests(rng, corpus, times),
                calibration(pools, MIXED_UTILIZATION, arrivals="Poisson"))


# ----- bursty -----------------------------------------------------------------------------

BURST_ON_S, BURST_OFF_S = 4.0, 8.0  # model seconds
BURST_ON_LOAD, BURST_OFF_LOAD = 1.6, 0.3  # × round-robin capacity


def build_bursty(seed: int, duration: float, time_scale: float) -> Plan:
    rng = random.Random(f"bursty:{seed}")
    corpus = Corpus(rng)
    model = "llama-3.1-70b"
    pods = make_pods("a100", model, 4, "70b")
    caps = capacities(pods, CHAT_WORK)
    cap = round_robin_capacity(caps)
    mean = (BURST_ON_LOAD * BURST_ON_S + BURST_OFF_LOAD * BURST_OFF_S) / (BURST_ON_S + BURST_OFF_S)
    pool = PoolPlan(model, pods, mean * cap, caps)
    times = on_off_arrivals(rng, rate_on=BURST_ON_LOAD * cap, rate_off=BURST_OFF_LOAD * cap,
                            on_s=BURST_ON_S, off_s=BURST_OFF_S, duration=duration)
    reqs = _chat_requests(rng, corpus, [(t, model) for t in times])
    return Plan("bursty", [pool], time_scale, duration, reqs, calibration(
        [pool], mean, arrivals=(
            f"on/off Poisson: {BURST_OFF_S:g} s at {BURST_OFF_LOAD:g}x then {BURST_ON_S:g} s at "
            f"{BURST_ON_LOAD:g}x round-robin capacity (mean {mean:.2f}x)")))


# ----- prefix -----------------------------------------------------------------------------

PREFIX_UTILIZATION = 0.8
PREFIX_PROMPTS = 6  # distinct long system prompts
PREFIX_SYSTEM_TOKENS = (1500, 3000)  # uniform range of each system prompt's length
PREFIX_USER = (150.0, 0.8, 16, 1024)  # the per-request question after the system prompt
PREFIX_OUTPUT = (120.0, 0.6, 8, 512)
PREFIX_ZIPF = 1.0


def build_prefix(seed: int, duration: float, time_scale: float) -> Plan:
    rng = random.Random(f"prefix:{seed}")
    corpus = Corpus(rng)
    model = "llama-3.1-8b"
    pods = make_pods("a10g", model, 4, "8b")
    systems = [corpus.text_of(rng.randint(*PREFIX_SYSTEM_TOKENS)) for _ in range(PREFIX_PROMPTS)]
    weights = [1.0 / (k + 1) ** PREFIX_ZIPF for k in range(PREFIX_PROMPTS)]
    sys_tokens = [len(s) / 4 for s in systems]
    mean_sys = sum(w * t for w, t in zip(weights, sys_tokens, strict=True)) / sum(weights)
    user_mean = lognormal_mean(*PREFIX_USER[:2])
    out_mean = lognormal_mean(*PREFIX_OUTPUT[:2])
    # Calibrated as round-robin would run warm: every pod has every system prompt cached
    # (only the question is prefilled); the cached prompts take their share of the KV cache
    # once, the running requests hold their own question and output.
    work = Workload(prefill_tokens=user_mean, prompt_tokens=user_mean + sum(sys_tokens) / 8,
                    output_tokens=out_mean)
    caps = capacities(pods, work)
    pool = PoolPlan(model, pods, PREFIX_UTILIZATION * round_robin_capacity(caps), caps)
    reqs = []
    for i, t in enumerate(poisson_arrivals(rng, pool.rate, 0.0, duration)):
        k = rng.choices(range(PREFIX_PROMPTS), weights)[0]
        user = corpus.text_of(lognormal(rng, *PREFIX_USER))
        output = lognormal(rng, *PREFIX_OUTPUT)
        reqs.append(chat_request(i, t, model, model, user, output, f"system-{k}", systems[k]))
    return Plan("prefix", [pool], time_scale, duration, reqs, calibration(
        [pool], PREFIX_UTILIZATION, arrivals="Poisson",
        system_prompt_tokens=[round(t) for t in sys_tokens],
        mean_system_prompt_tokens=round(mean_sys),
        system_prompts_total_tokens=round(sum(sys_tokens)),
        pod_kv_cache_tokens=kv_tokens("a10g", model)))


def kv_tokens(gpu: str, model: str) -> int:
    """Tokens of KV cache one pod of this GPU and model holds."""
    from simulator.profiles import build_profile

    prof = build_profile(gpu, model)
    return prof.num_gpu_blocks * prof.block_size


# ----- uniform ----------------------------------------------------------------------------

UNIFORM_UTILIZATION = 0.85


def build_uniform(seed: int, duration: float, time_scale: float) -> Plan:
    rng = random.Random(f"uniform:{seed}")
    corpus = Corpus(rng)
    model = "llama-3.1-70b"
    pods = make_pods("a100", model, 4, "70b")
    caps = capacities(pods, CHAT_WORK)
    pool = PoolPlan(model, pods, UNIFORM_UTILIZATION * round_robin_capacity(caps), caps)
    times = [(t, model) for t in poisson_arrivals(rng, pool.rate, 0.0, duration)]
    return Plan("uniform", [pool], time_scale, duration, _chat_requests(rng, corpus, times),
                calibration([pool], UNIFORM_UTILIZATION, arrivals="Poisson"))


# ----- lora -------------------------------------------------------------------------------

LORA_UTILIZATION = 0.5
LORA_ADAPTERS = 8
LORA_SLOTS = 4
LORA_ZIPF = 1.0


def build_lora(seed: int, duration: float, time_scale: float) -> Plan:
    rng = random.Random(f"lora:{seed}")
    corpus = Corpus(rng)
    model = "llama-3.1-8b"
    adapters = [f"adapter-{k}" for k in range(LORA_ADAPTERS)]
    pods = make_pods("a10g", model, 4, "8b", lora_adapters=adapters, max_loras=LORA_SLOTS)
    caps = capacities(pods, CHAT_WORK)
    pool = PoolPlan(model, pods, LORA_UTILIZATION * round_robin_capacity(caps), caps)
    weights = [1.0 / (k + 1) ** LORA_ZIPF for k in range(LORA_ADAPTERS)]
    reqs = []
    for i, t in enumerate(poisson_arrivals(rng, pool.rate, 0.0, duration)):
        adapter = rng.choices(adapters, weights)[0]
        prompt, output = _chat_lengths(rng)
        user = corpus.text_of(prompt)
        reqs.append(chat_request(i, t, adapter, model, user, output, adapter))
    return Plan("lora", [pool], time_scale, duration, reqs, calibration(
        [pool], LORA_UTILIZATION, arrivals="Poisson", adapters=LORA_ADAPTERS,
        adapter_slots_per_pod=LORA_SLOTS, adapter_popularity=f"Zipf s={LORA_ZIPF:g}"))


# ----- tiny (smoke test) ----------------------------------------------------------------------


def build_tiny(seed: int, duration: float, time_scale: float) -> Plan:
    """Two pods (one fast, one slow), short requests: for the smoke test only."""
    rng = random.Random(f"tiny:{seed}")
    corpus = Corpus(rng, chars=200_000)
    model = "llama-3.1-8b"
    pods = make_pods("h100", model, 1, "8b") + make_pods("a10g", model, 1, "8b")
    caps = capacities(pods, Workload(200, 200, 24))
    pool = PoolPlan(model, pods, 0.5 * round_robin_capacity(caps), caps)
    reqs = []
    for i, t in enumerate(poisson_arrivals(rng, pool.rate, 0.0, duration)):
        user = corpus.text_of(lognormal(rng, 150, 0.5, 16, 512))
        output = lognormal(rng, 16, 0.5, 4, 48)
        reqs.append(chat_request(i, t, model, model, user, output, model))
    return Plan("tiny", [pool], time_scale, duration, reqs, calibration([pool], 0.5))


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "mixed", "Mixed GPU generations, two model sizes",
            ("mixed GPU generations (Llama-3.1-8B)", "mixed GPU generations (Qwen3-32B)"),
            "Two pools behind one gateway: llama-3.1-8b on 2 x H100 + 4 x A10G and qwen3-32b "
            "on 2 x H100 (TP2) + 2 x A10G (TP4): a fleet grown over GPU generations, where an "
            "H100 prefills ~14x and decodes ~5x faster than an A10G. ShareGPT-like chat "
            "(log-normal prompt median 400 tokens, output median 150), Poisson arrivals per "
            f"pool at {MIXED_UTILIZATION:.0%} of the pool's round-robin capacity (the A10Gs "
            "are then near saturation under round-robin while the H100s idle).",
            time_scale=2.0, wall_duration_s=12.0, build=build_mixed),
        Scenario(
            "bursty", "Bursty traffic on a uniform fleet",
            ("bursty (Llama-3.1-70B)", "bursty (Qwen3-235B)"),
            "llama-3.1-70b on 4 identical 4 x A100 pods. On/off arrivals: "
            f"{BURST_OFF_S:g} model-seconds at {BURST_OFF_LOAD:g}x round-robin capacity, then "
            f"{BURST_ON_S:g} s bursts at {BURST_ON_LOAD:g}x (well above capacity), mean "
            "below capacity. ShareGPT-like chat lengths (heavy-tailed: a burst's pods get very "
            "different amounts of work under round-robin).",
            time_scale=2.0, wall_duration_s=12.0, build=build_bursty),
        Scenario(
            "prefix", "Shared system prompts",
            ("shared prompt prefix (Llama-3.1-8B)",),
            f"llama-3.1-8b on 4 x A10G (24 GB: 27k tokens of KV cache each). "
            f"{PREFIX_PROMPTS} long system prompts ({PREFIX_SYSTEM_TOKENS[0]}-"
            f"{PREFIX_SYSTEM_TOKENS[1]} tokens, Zipf popularity) shared by every request, "
            "each followed by a short question (log-normal median 150 tokens), output median "
            f"120. Poisson at {PREFIX_UTILIZATION:.0%} of round-robin capacity computed as if "
            "every pod had every system prompt cached.",
            time_scale=4.0, wall_duration_s=12.0, build=build_prefix,
            # 48 model s hold 220 requests, and the first request of each cold system prompt
            # on each pod it reaches (six at least, 1.1-2.1 s) make the whole tail: the p95
            # (the 11th slowest) is ~0.7-0.9 s with six such cold prefills, ~1.1-1.3 s with
            # eight or more (in the twin by seed, live by run; docs/benchmarks.md, "The
            # published prefix plan, rerun"). 192 s hold 882 and the p95 moves by ~3 %.
            comparison_span=4.0),
        Scenario(
            "uniform", "Uniform fleet, steady traffic",
            ("uniform fleet steady traffic (Qwen3-235B)",),
            "llama-3.1-70b on 4 identical 4 x A100 pods (the published row used Qwen3-235B, an "
            "MoE the simulator has no profile for; a dense 70B on identical pods is the same "
            "situation for a router), ShareGPT-like chat, Poisson at "
            f"{UNIFORM_UTILIZATION:.0%} of capacity.",
            time_scale=2.0, wall_duration_s=12.0, build=build_uniform),
        Scenario(
            "lora", "Many LoRA adapters, few adapter slots",
            (),
            f"llama-3.1-8b on 4 x A10G, {LORA_ADAPTERS} adapters served by every pod with "
            f"{LORA_SLOTS} resident slots each (vLLM --max-loras {LORA_SLOTS}); every request "
            f"names an adapter (Zipf popularity), ShareGPT-like chat, Poisson at "
            f"{LORA_UTILIZATION:.0%} of round-robin capacity. A request whose adapter cannot "
            "get a slot waits until a running request of another adapter finishes.",
            time_scale=4.0, wall_duration_s=12.0, build=build_lora),
        Scenario(
            "tiny", "Smoke test", (), "One H100 and one A10G pod, short requests, 50% load.",
            time_scale=4.0, wall_duration_s=3.0, build=build_tiny),
    )
}
ALL = ("mixed", "bursty", "prefix", "uniform", "lora")
