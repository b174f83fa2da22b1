"""JWT identity at the global tier, for real: the front door's Envoy checks the token
(jwt_authn, before the router), its claim names the tenant, the router's limits apply.

One real Tier-1 gateway (`igw serve`) in front of a simulated pod, one real `igw global
serve` with `spec.auth.jwt` (a local JWKS of an ES256 key made here) and
`spec.tenants.jwtClaim`. Nothing is mocked.
"""

from __future__ import annotations

import contextlib
import json
import ssl
import time

import httpx
from cryptography.hazmat.primitives.asymmetric import ec

from contract import headers as hdr
from tests.jwt_keys import es256_token, jwks
from tests.procs import gateway, gateway_config, global_config, global_router, sim_fleet
from tests.test_tenants_gateway import assert_401

MODEL = "llama-3.1-8b"
ISSUER = "https://issuer.test"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_the_token_names_the_tenant_and_the_global_limits_hold(tmp_path):
    key = ec.generate_private_key(ec.SECP256R1())
    jwks_file = tmp_path / "jwks.json"
    jwks_file.write_text(json.dumps(jwks(key)))
    claims = {"iss": ISSUER, "aud": "igw", "sub": "u", "exp": int(time.time()) + 600}
    with contextlib.ExitStack() as stack:
        fleet = stack.enter_context(sim_fleet(
            tmp_path, [{"name": "p0", "gpu": "h100", "model": MODEL}], time_scale=20.0))
        tier1 = stack.enter_context(gateway(tmp_path, gateway_config(
            [{"name": "pool", "modelName": MODEL, "endpoints": fleet.addresses()}])))
        region = {"name": "us-east-1", "endpoint": f"127.0.0.1:{tier1.ports['listen']}",
                  "caFile": str(tier1.ca)}
        router = stack.enter_context(global_router(tmp_path, global_config(
            [region], models=[{"name": MODEL, "policy": "fastest"}],
            polling={"interval": "100ms", "staleAfter": "1s"},
            auth={"jwt": {"issuer": ISSUER, "audiences": ["igw"], "jwksFile": str(jwks_file)}},
            tenants={"jwtClaim": "team", "list": [
                {"name": "team-a", "limits": {"requestsPerMinute": 1}}]})))
        ctx = ssl.create_default_context(cafile=str(router.ca))
        http = stack.enter_context(httpx.Client(base_url=router.url, verify=ctx, timeout=30))

        def post(token: str | None, **headers: str) -> httpx.Response:
            if token:
                headers["authorization"] = f"Bearer {token}"
            return http.post("/v1/chat/completions", json=BODY, headers=headers)

        assert http.get("/healthz").status_code == 200  # probes need no token
        team_a = es256_token(key, {**claims, "team": "team-a"})
        deadline = time.monotonic() + 20
        served = post(team_a)
        while served.status_code == 503 and time.monotonic() < deadline:  # region not fresh yet
            time.sleep(0.2)
            served = post(team_a)
        assert served.status_code == 200, served.text
        assert served.headers[hdr.REGION] == "us-east-1"
        assert served.headers["x-ratelimit-limit-requests"] == "1"
        refused = post(team_a)
        assert refused.status_code == 429 and "retry-after" in refused.headers  # 1 a minute
        no_claim = es256_token(key, claims)
        assert_401(post(no_claim, **{hdr.TENANT: "team-a"}))  # a forged header is stripped
        assert_401(post(es256_token(key, {**claims, "team": "team-z"})))  # not a tenant
        # Envoy's own refusals, before the router: another issuer, no token, not a JWT
        for token in (es256_token(key, {**claims, "team": "team-a", "iss": "https://evil"}),
                      None, "not-a-jwt"):
            reply = post(token)
            assert reply.status_code == 401, reply.text
            assert reply.json()["error"]["code"] == "invalid_token"
