"""Mutual TLS between the tiers, for real: two Tier-1 gateways (`igw serve`) with
`spec.tls.clientCaFile`, one of them also `requireClientCertificate`, and a real
`igw global serve` presenting its certificate (`spec.regionClientTls`) on its polls and
on the traffic its Envoy sends. Nothing is mocked."""

from __future__ import annotations

import contextlib
import ssl
import time

import httpx
import pytest

from contract import headers as hdr
from tests.client_certs import issue_client_certificate
from tests.procs import gateway, gateway_config, global_config, global_router, sim_fleet

MODEL = "llama-3.1-8b"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _tier1(fleet, name: str, pod: str, client_ca, require: bool) -> dict:
    config = gateway_config([{"name": "pool", "modelName": MODEL,
                              "endpoints": [fleet.address(pod)]}])
    config["metadata"]["name"] = name
    config["spec"]["tls"] = {"clientCaFile": str(client_ca),
                             "requireClientCertificate": require}
    return config


def _context(ca, client=None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    if client is not None:
        context.load_cert_chain(str(client.cert), str(client.key))
    return context


def test_only_the_router_reads_the_summaries_and_traffic_flows_through_it(tmp_path):
    client = issue_client_certificate(tmp_path / "clients")
    pods = [{"name": f"p{i}", "gpu": "h100", "model": MODEL} for i in range(2)]
    with contextlib.ExitStack() as stack:
        fleet = stack.enter_context(sim_fleet(tmp_path, pods, time_scale=20.0))
        verified = stack.enter_context(gateway(tmp_path, _tier1(fleet, "a", "p0", client.ca,
                                                                False)))
        required = stack.enter_context(gateway(tmp_path, _tier1(fleet, "b", "p1", client.ca,
                                                                True)))
        regions = [
            {"name": name, "endpoint": f"127.0.0.1:{gw.ports['listen']}",
             "caFile": str(gw.ca), "costs": {MODEL: {"perMillionTokens": price}}}
            for name, gw, price in (("verified", verified, 0.1), ("required", required, 0.2))
        ]
        router = stack.enter_context(global_router(tmp_path, global_config(
            regions, models=[{"name": MODEL, "policy": "cheapest-within-slo", "ttftSlo": "10s"}],
            polling={"interval": "100ms", "staleAfter": "1s"},
            regionClientTls={"certificateFile": str(client.cert), "keyFile": str(client.key)})))

        summary = hdr.LOAD_SUMMARY_PATH
        # without a certificate: the summary is refused, inference is served
        with httpx.Client(base_url=verified.url, verify=_context(verified.ca), timeout=30) as h:
            refused = h.get(summary)
            assert refused.status_code == 403, refused.text
            assert h.post("/v1/chat/completions", json=BODY).status_code == 200
        with httpx.Client(base_url=verified.url, verify=_context(verified.ca, client),
                          timeout=30) as h:
            assert h.get(summary).json()["pools"][0]["model"] == MODEL
        # a gateway that requires one: no TLS session at all without it
        with (httpx.Client(base_url=required.url, verify=_context(required.ca),
                           timeout=30) as h, pytest.raises(httpx.TransportError)):
            h.post("/v1/chat/completions", json=BODY)

        deadline = time.monotonic() + 30
        while True:
            regions_seen = httpx.get(router.status_url, timeout=5).json()["regions"]
            if all(r["fresh"] for r in regions_seen):
                break
            assert time.monotonic() < deadline, regions_seen
            time.sleep(0.2)
        with httpx.Client(base_url=router.url, verify=_context(router.ca), timeout=30) as h:
            cheap = h.post("/v1/chat/completions", json=BODY)
            assert cheap.status_code == 200 and cheap.headers[hdr.REGION] == "verified"
            pinned = h.post("/v1/chat/completions", json=BODY,
                            headers={hdr.REGIONS: "required"})
            assert pinned.status_code == 200, pinned.text  # Envoy presented the certificate
            assert pinned.headers[hdr.REGION] == "required"
