"""Cross-check our load generator's TTFT against a third-party client, guidellm.

    igw bench --guidellm-check [--guidellm PATH]     (or python -m bench.guidellm_check)

guidellm (PyPI; it pulls torch and transformers, so keep it in its own venv:
`python -m venv /opt/gl && /opt/gl/bin/pip install guidellm==0.8.1 torch==2.13.0+cpu`)
runs fully offline from a JSON-lines prompt file (no tokenizer download: it takes token
counts from the server's usage). Both clients send the same prompts with the same output
lengths at the same constant rate to the same target, on a fresh fleet each time:
- `pod`: one simulated H100 pod directly (TTFT there is a known function of the prompt
  length, so both clients can also be checked against the engine's own model);
- `gateway`: the `tiny` fleet (one H100, one A10G) behind this gateway (llm-d), HTTPS.
time_scale is 1, so wall and model seconds coincide. Agreement is judged on the median and
p95 TTFT; results go to bench/results/guidellm-check.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.fleet import SimFleet
from bench.loadgen import LoadGenerator
from bench.output import write_results
from bench.routers import ROUTERS
from bench.runner import _ssl_context, tls_material
from bench.workload import Corpus, RequestSpec, chat_body, chat_prompt_tokens, lognormal

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "llama-3.1-8b"
RATE = 4.0
REQUESTS = 120


def prompts(seed: int = 11) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    corpus = Corpus(rng, chars=400_000)
    return [(corpus.text_of(lognormal(rng, 400, 0.6, 64, 2048)), lognormal(rng, 32, 0.5, 8, 96))
            for _ in range(REQUESTS)]


def _stats(ttft_ms: list[float]) -> dict[str, float]:
    a = np.asarray(ttft_ms, dtype=float)
    return {"n": len(a), "mean_ms": round(float(a.mean()), 2),
            "p50_ms": round(float(np.percentile(a, 50)), 2),
            "p95_ms": round(float(np.percentile(a, 95)), 2),
            "max_ms": round(float(a.max()), 2)}


def run_guidellm(exe: str, url: str, data: Path, work: Path, verify: bool) -> dict[str, Any]:
    out = work / "guidellm.json"
    spec = {"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": MODEL,
                    "request_format": "/v1/chat/completions", "validate_backend": False,
                    "verify": verify},
        "profile": {"kind": "constant", "rate": [RATE]},
        "data": [{"kind": "json_file", "path": str(data)}],
        "constraints": [{"kind": "max_requests", "count": REQUESTS}],
        "outputs": [{"kind": "json", "path": str(out)}],
    }}
    scenario = work / "guidellm-scenario.json"
    scenario.write_text(json.dumps(spec))
    proc = subprocess.run([exe, "run", "--scenario", str(scenario), "--disable-progress"],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm failed ({proc.returncode}): {proc.stderr[-2000:]}")
    doc = json.loads(out.read_text())
    reqs = doc["benchmarks"][0]["requests"]["successful"]
    return _stats([r["time_to_first_token_ms"] for r in reqs])


async def run_ours(url: str, items: list[tuple[str, int]], tls) -> dict[str, Any]:
    specs = [RequestSpec(index=i, at=i / RATE, model=MODEL, pool=MODEL,
                         body=chat_body(MODEL, text, out), prompt_tokens=chat_prompt_tokens(text),
                         max_tokens=out) for i, (text, out) in enumerate(items)]
    gen = LoadGenerator(specs, lambda _r: url + "/v1/chat/completions", time_scale=1.0,
                        ssl_context=_ssl_context(tls) if url.startswith("https") else None)
    results = await gen.run()
    return _stats([r.ttft_s * 1000 for r in results if r.ttft_s is not None and not r.error])


def model_ttft_ms(items: list[tuple[str, int]]) -> dict[str, float]:
    """The engine's own TTFT for a lone request on an idle H100 (docs/simulator.md)."""
    from simulator.profiles import build_profile

    prof = build_profile("h100", MODEL)
    step_ms = prof.base_step_ms + prof.per_seq_ms
    return _stats([step_ms + 1000 * chat_prompt_tokens(t) / prof.prefill_tokens_per_s
                   for t, _ in items])


async def check(exe: str, work: Path) -> dict[str, Any]:
    items = prompts()
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": t, "output_tokens_count": o}) + "\n"
                            for t, o in items))
    tls = tls_material(work)
    out: dict[str, Any] = {"rate_rps": RATE, "requests": REQUESTS,
                           "engine_model_idle_h100": model_ttft_ms(items)}
    async with aiohttp.ClientSession() as session:
        # a lone H100 pod, directly
        fleet = SimFleet.start(work / "pod", [{"name": "pod-h100", "gpu": "h100",
                                               "model": MODEL}], seed=0, time_scale=1.0)
        try:
            url = fleet.pods[0].url
            out["pod"] = {"guidellm": await asyncio.to_thread(
                run_guidellm, exe, url, data, work, False)}
            await fleet.reset(session)
            out["pod"]["ours"] = await run_ours(url, items, tls)
        finally:
            fleet.stop()
        # the tiny mixed fleet behind the gateway
        fleet = SimFleet.start(work / "gw", [
            {"name": "8b-h100-0", "gpu": "h100", "model": MODEL},
            {"name": "8b-a10g-0", "gpu": "a10g", "model": MODEL}], seed=0, time_scale=1.0)
        try:
            out["gateway"] = {}
            for client in ("guidellm", "ours"):
                await fleet.reset(session)  # fresh caches: the same prompts run twice
                router = ROUTERS["igw-llm-d"].make()
                try:
                    await asyncio.to_thread(router.start, work, fleet, tls, 1.0)
                    await asyncio.to_thread(router.wait_ready, fleet)
                    url = router.urls[MODEL]
                    if client == "guidellm":
                        out["gateway"][client] = await asyncio.to_thread(
                            run_guidellm, exe, url, data, work, False)
                    else:
                        out["gateway"][client] = await run_ours(url, items, tls)
                finally:
                    await asyncio.to_thread(router.stop)
        finally:
            fleet.stop()
    return out


def render(doc: dict[str, Any]) -> str:
    lines = [
        "# TTFT cross-check: our load generator vs guidellm",
        "",
        f"{doc.get('guidellm_version', 'guidellm ?')}; same {doc['requests']} prompts "
        f"(log-normal, median 400 tokens) and output lengths, constant {doc['rate_rps']:g} "
        "req/s, fresh pods for each client, time_scale 1. Method: bench/guidellm_check.py.",
        "",
        "| target | client | n | TTFT mean | p50 | p95 | max |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    m = doc["engine_model_idle_h100"]
    lines.append(f"| engine model, idle H100 | (computed) | {m['n']} | {m['mean_ms']} ms "
                 f"| {m['p50_ms']} ms | {m['p95_ms']} ms | {m['max_ms']} ms |")
    for target in ("pod", "gateway"):
        for client in ("guidellm", "ours"):
            s = doc[target][client]
            lines.append(f"| {target} | {client} | {s['n']} | {s['mean_ms']} ms | {s['p50_ms']} ms "
                         f"| {s['p95_ms']} ms | {s['max_ms']} ms |")
    lines.append("")
    for target in ("pod", "gateway"):
        g, o = doc[target]["guidellm"], doc[target]["ours"]
        lines.append(f"- {target}: p50 ours − guidellm = {o['p50_ms'] - g['p50_ms']:+.2f} ms, "
                     f"p95 {o['p95_ms'] - g['p95_ms']:+.2f} ms.")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="igw bench --guidellm-check")
    p.add_argument("--guidellm", default=shutil.which("guidellm"),
                   help="path of the guidellm executable (default: on PATH)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if not args.guidellm:
        print("guidellm not found: install it (see bench/guidellm_check.py) and pass "
              "--guidellm PATH", file=sys.stderr)
        return 2
    version = subprocess.run([args.guidellm, "--version"], capture_output=True, text=True,
                             check=False).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="igw-guidellm-") as tmp:
        doc = asyncio.run(check(args.guidellm, Path(tmp)))
    doc["guidellm_version"] = version
    write_results(args.out, "guidellm-check", doc, render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
