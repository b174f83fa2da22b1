"""Tier 2: the global router, the picker framework one level up (docs/global.md).

Regions (Tier-1 gateways) are the candidates. Layering inside, in the order a
request meets them: `regions` (what is known about every region: its
summary, freshness, RTT, per-model arrays) ← `poller` (fills it in the
background) → `placement` (filters, then the policy's order) → `director`
(body → model → placement → the answer for Envoy) → `app` (the process: the
ext_proc server of picker.h2_grpc with picker.handlers' state machine, the
poller, the status and metrics HTTP server).

It builds on picker (the transport, the stream state machine, tenant
identity), bbr (reading the body) and contract; igw starts it.
"""
