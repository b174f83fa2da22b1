"""Config loading: the HyperPod example verbatim, our additions, one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from contract.config import (
    ConfigError,
    CoordinationConfig,
    GatewayConfig,
    MetricsConfig,
    RateLimits,
    SchedulerConfig,
    TenantConfig,
    TenantsConfig,
    load_config,
    load_config_text,
    parse_config,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "hyperpod-example.yaml"


def doc(**spec_overrides):
    base = yaml.safe_load(EXAMPLE.read_text())
    base["spec"].update(spec_overrides)
    return base


def error_of(document) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(document)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_hyperpod_example_loads_unchanged():
    config = load_config(EXAMPLE)
    (sched,) = config.schedulers
    assert config.name == "my-gateway"
    assert config.bbr.enabled
    assert sched.model_name == "llama-3.1-70b"
    assert sched.match_labels == {"app": "vllm-llama"}
    assert sched.target_port == 8000
    assert sched.scheduler == "llm-d"
    assert sched.engine_type == "vllm"
    assert config.tls.certificate_file is None


def test_our_additions_and_durations():
    d = doc()
    d["spec"]["schedulers"][0].update(
        endpoints=["127.0.0.1:8001", "[::1]:8002", "pod-a.local:8000"],
        routeTimeout="90s",
        weights={"queue": 1, "prefix": 5},
        metrics={"interval": "100ms", "staleAfter": "3s"},
        loraAdapters=["sql-lora"],
    )
    d["spec"].update(listener={"port": 9443}, failureMode="open", maxFallbacks=3)
    config = parse_config(d)
    sched = config.schedulers[0]
    assert sched.endpoints[1] == "[::1]:8002"
    assert sched.route_timeout_s == 90
    assert sched.weights == {"queue": 1.0, "prefix": 5.0}
    assert sched.metrics.interval_s == pytest.approx(0.1)
    assert config.listen_port == 9443 and config.failure_mode == "open"
    assert config.scheduler_for_model("llama-3.1-70b") is sched


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["spec"].update(colour="blue"), "spec.colour: unknown field"),
        (
            lambda d: d["spec"]["schedulers"][0].update(modelname="x"),
            "spec.schedulers[0].modelname: unknown field",
        ),
        (
            lambda d: d["spec"]["schedulers"][0].update(weights={"kvcache": 1}),
            "spec.schedulers[0].weights.kvcache: unknown field",
        ),
        (
            lambda d: d["spec"]["schedulers"][0].update(targetPort=70000),
            "spec.schedulers[0].targetPort",
        ),
        (
            lambda d: d["spec"]["schedulers"][0].update(targetPort="8000"),
            "spec.schedulers[0].targetPort",
        ),
        (
            lambda d: d["spec"]["schedulers"][0].update(scheduler="fastest"),
            "spec.schedulers[0].scheduler",
        ),
        (
            lambda d: d["spec"]["schedulers"][0].update(endpoints=["nohost"]),
            "spec.schedulers[0].endpoints[0]",
        ),
        (
            lambda d: d["spec"]["schedulers"][0].update(routeTimeout="soon"),
            "spec.schedulers[0].routeTimeout",
        ),
        (
            lambda d: d["spec"]["bbr"].update(maxRequestBodyBytes=2**30),
            "spec.bbr.maxRequestBodyBytes",
        ),
        (lambda d: d["spec"].update(listener={"port": 0}), "spec.listener.port"),
        (lambda d: d["spec"].update(failureMode="maybe"), "spec.failureMode"),
        (lambda d: d.update(kind="Gateway"), "kind"),
        (lambda d: d["spec"]["schedulers"][0].pop("modelName"), "spec.schedulers[0].modelName"),
        (
            lambda d: d["spec"]["schedulers"][0].update(saturation={"maxStartDelay": "-1s"}),
            "spec.schedulers[0].saturation.maxStartDelay",
        ),
        (
            lambda d: d["spec"]["schedulers"][0].update(saturation={"maxStartDelay": True}),
            "spec.schedulers[0].saturation.maxStartDelay",
        ),
        (
            lambda d: d["spec"]["schedulers"][0].update(saturation={"slotAllowance": -1}),
            "spec.schedulers[0].saturation.slotAllowance",
        ),
        (
            lambda d: d["spec"]["schedulers"][0].update(saturation={"slotAllowance": 1.5}),
            "spec.schedulers[0].saturation.slotAllowance",
        ),
        (
            lambda d: d["spec"]["schedulers"][0].update(saturation={"fairShareWindow": "-1s"}),
            "spec.schedulers[0].saturation.fairShareWindow",
        ),
        (
            lambda d: d["spec"]["schedulers"][0].update(saturation={"fairShareWindow": True}),
            "spec.schedulers[0].saturation.fairShareWindow",
        ),
    ],
)
def test_one_line_error_names_the_field(mutate, field):
    d = doc()
    mutate(d)
    assert field in error_of(d)


def test_flow_control_bound_defaults_parses_and_turns_off():
    assert parse_config(doc()).schedulers[0].saturation.max_start_delay_s == 2.0
    for value, seconds in (("500ms", 0.5), (3, 3.0), ("0s", 0.0), (0, 0.0)):
        d = doc()
        d["spec"]["schedulers"][0]["saturation"] = {"maxStartDelay": value}
        assert parse_config(d).schedulers[0].saturation.max_start_delay_s == seconds


def test_slot_allowance_and_fair_share_window_default_parse_and_turn_off():
    sat = parse_config(doc()).schedulers[0].saturation
    assert (sat.slot_allowance, sat.fair_share_window_s) == (1, 5.0)
    for allowance, window, seconds in ((0, "0s", 0.0), (3, "500ms", 0.5), (2, 10, 10.0)):
        d = doc()
        d["spec"]["schedulers"][0]["saturation"] = {
            "slotAllowance": allowance, "fairShareWindow": window}
        sat = parse_config(d).schedulers[0].saturation
        assert (sat.slot_allowance, sat.fair_share_window_s) == (allowance, seconds)


def test_duplicate_model_name():
    d = doc()
    second = dict(d["spec"]["schedulers"][0], name="llama-70b-b")
    d["spec"]["schedulers"].append(second)
    assert "spec.schedulers[1].modelName: duplicate model 'llama-3.1-70b'" in error_of(d)


def test_adapter_clashing_with_a_model_is_a_duplicate():
    d = doc()
    d["spec"]["schedulers"].append(
        {
            "name": "b",
            "modelName": "other",
            "endpoints": ["127.0.0.1:1"],
            "loraAdapters": ["llama-3.1-70b"],
        }
    )
    assert "spec.schedulers[1].loraAdapters[0]: duplicate model" in error_of(d)


def test_two_schedulers_need_bbr():
    d = doc(bbr={"enabled": False})
    d["spec"]["schedulers"].append({"name": "b", "modelName": "m2", "endpoints": ["127.0.0.1:1"]})
    assert error_of(d).startswith("spec.bbr.enabled")


def test_bad_yaml_is_one_line():
    with pytest.raises(ConfigError) as info:
        load_config_text("spec: [unclosed")
    assert "not valid YAML" in str(info.value)


def test_igw_validate_cli(tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "igw.cli", "validate", str(EXAMPLE)], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    assert "valid" in ok.stdout
    bad = tmp_path / "bad.yaml"
    d = doc()
    d["spec"]["schedulers"][0]["targetPort"] = 0
    bad.write_text(yaml.safe_dump(d))
    res = subprocess.run(
        [sys.executable, "-m", "igw.cli", "validate", str(bad)], capture_output=True, text=True
    )
    assert res.returncode == 1
    assert "spec.schedulers[0].targetPort" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_an_omitted_field_takes_the_models_own_default():
    """The parser must not carry a second copy of any default."""
    config = parse_config({
        "apiVersion": "inference-gateway.io/v1alpha1",
        "kind": "InferenceGatewayConfig",
        "spec": {"schedulers": [{"name": "p", "modelName": "m", "endpoints": ["h:1"]}]},
    })
    expected = SchedulerConfig(name="p", model_name="m", endpoints=("h:1",))
    assert config.schedulers == (expected,)
    assert config == GatewayConfig(schedulers=(expected,))


def test_models_are_keyword_only():
    with pytest.raises(TypeError):
        MetricsConfig("scrape")  # type: ignore[misc]


def test_coordination_absent_by_default_and_parsed_when_given():
    assert parse_config(doc()).coordination is None
    config = parse_config(doc(coordination={"url": "redis://127.0.0.1:6379/0"}))
    assert config.coordination == CoordinationConfig(url="redis://127.0.0.1:6379/0")
    assert config.coordination_prefix == f"igw:{config.namespace}:{config.name}"
    tuned = parse_config(
        doc(
            coordination={
                "url": "rediss://cache:6380/1",
                "passwordFile": "/secrets/redis",
                "keyPrefix": "igw:blue",
                "flushInterval": "2ms",
                "heartbeatInterval": "500ms",
                "replicaTimeout": "3s",
                "streamMaxLen": 5000,
                "shareScrapes": False,
            }
        )
    ).coordination
    assert tuned is not None
    assert config.coordination.share_scrapes and not tuned.share_scrapes
    assert (tuned.flush_interval_s, tuned.heartbeat_interval_s, tuned.replica_timeout_s) == (
        0.002, 0.5, 3.0,
    )
    assert tuned.password_file == "/secrets/redis" and tuned.stream_max_len == 5000
    assert parse_config(doc(coordination={"url": "redis://r", "keyPrefix": "igw:blue"})) \
        .coordination_prefix == "igw:blue"


@pytest.mark.parametrize(
    ("coordination", "field"),
    [
        ({}, "spec.coordination.url"),
        ({"url": "http://redis:6379"}, "spec.coordination.url"),
        ({"url": "redis://r", "colour": 1}, "spec.coordination.colour"),
        ({"url": "redis://r", "flushInterval": "soon"}, "spec.coordination.flushInterval"),
        ({"url": "redis://r", "replicaTimeout": "1s"}, "spec.coordination.replicaTimeout"),
        ({"url": "redis://r", "streamMaxLen": 5}, "spec.coordination.streamMaxLen"),
        ({"url": "redis://r", "bufferSize": "big"}, "spec.coordination.bufferSize"),
        ({"url": "redis://r", "keyPrefix": ""}, "spec.coordination.keyPrefix"),
        ({"url": "redis://r", "shareScrapes": "yes"}, "spec.coordination.shareScrapes"),
        ("redis://r", "spec.coordination"),
    ],
)
def test_coordination_errors_name_the_field(coordination, field):
    assert field in error_of(doc(coordination=coordination))


TEAMS = [
    {
        "name": "team-a",
        "weight": 3,
        "limits": {"requestsPerMinute": 600, "tokensPerMinute": 200_000},
        "modelLimits": {"llama-3.1-70b": {"maxConcurrentRequests": 4}},
    },
    {"name": "team_b.eu"},
]


def test_tenants_absent_by_default_and_parsed_when_given():
    assert parse_config(doc()).tenants is None
    tenants = parse_config(
        doc(tenants={"keysFile": "/etc/igw/keys", "list": TEAMS})
    ).tenants
    assert tenants == TenantsConfig(
        keys_file="/etc/igw/keys",
        tenants=(
            TenantConfig(
                name="team-a",
                weight=3.0,
                limits=RateLimits(requests_per_minute=600, tokens_per_minute=200_000),
                model_limits={"llama-3.1-70b": RateLimits(max_concurrent_requests=4)},
            ),
            TenantConfig(name="team_b.eu"),
        ),
    )
    assert tenants.failure_mode == "open"
    assert tenants.limits() == {
        ("team-a", ""): RateLimits(requests_per_minute=600, tokens_per_minute=200_000),
        ("team-a", "llama-3.1-70b"): RateLimits(max_concurrent_requests=4),
        ("team_b.eu", ""): RateLimits(),
    }


def test_tenants_from_a_jwt_claim():
    jwt = {"jwt": {"issuer": "https://idp", "jwksFile": "/jwks.json"}}
    tenants = parse_config(
        doc(auth=jwt, tenants={"jwtClaim": "org.team", "failureMode": "closed", "list": TEAMS})
    ).tenants
    assert (tenants.jwt_claim, tenants.keys_file, tenants.failure_mode) == (
        "org.team", None, "closed"
    )


KEYS = {"keysFile": "/k"}


@pytest.mark.parametrize(
    ("tenants", "field"),
    [
        ({"list": TEAMS}, "exactly one of keysFile or jwtClaim"),
        ({**KEYS}, "spec.tenants.list"),
        ({**KEYS, "list": []}, "spec.tenants.list"),
        ({**KEYS, "list": [{"weight": 1}]}, "spec.tenants.list[0].name"),
        ({**KEYS, "list": [{"name": "a b"}]}, "spec.tenants.list[0].name"),
        ({**KEYS, "list": [{"name": "a"}, {"name": "a"}]}, "spec.tenants.list[1].name"),
        ({**KEYS, "list": [{"name": "a", "weight": 0}]}, "spec.tenants.list[0].weight"),
        ({**KEYS, "list": [{"name": "a", "colour": 1}]}, "spec.tenants.list[0].colour"),
        (
            {**KEYS, "list": [{"name": "a", "limits": {"requestsPerMinute": 0}}]},
            "spec.tenants.list[0].limits.requestsPerMinute",
        ),
        (
            {**KEYS, "list": [{"name": "a", "limits": {"tokensPerMinute": "lots"}}]},
            "spec.tenants.list[0].limits.tokensPerMinute",
        ),
        (
            {**KEYS, "list": [{"name": "a", "limits": {"rpm": 5}}]},
            "spec.tenants.list[0].limits.rpm",
        ),
        (
            {**KEYS, "list": [{"name": "a", "modelLimits": {"gpt-9": {}}}]},
            "spec.tenants.list[0].modelLimits.gpt-9",
        ),
        (
            {**KEYS, "list": [{"name": "a", "modelLimits": {"llama-3.1-70b": {"x": 1}}}]},
            "spec.tenants.list[0].modelLimits.llama-3.1-70b.x",
        ),
        ({**KEYS, "failureMode": "maybe", "list": TEAMS}, "spec.tenants.failureMode"),
        ({**KEYS, "keysFile": "", "list": TEAMS}, "spec.tenants.keysFile"),
        ({"jwtClaim": "tenant", "list": TEAMS}, "spec.tenants.jwtClaim: needs spec.auth.jwt"),
        ({"jwtClaim": "a b", "list": TEAMS}, "spec.tenants.jwtClaim"),
        ({**KEYS, "list": TEAMS, "extra": 1}, "spec.tenants.extra"),
        ("yes", "spec.tenants"),
    ],
)
def test_tenant_errors_name_the_field(tenants, field):
    assert field in error_of(doc(tenants=tenants))


def test_api_keys_and_jwt_exclude_each_other():
    jwt = {"jwt": {"issuer": "https://idp", "jwksFile": "/jwks.json"}}
    message = error_of(doc(auth=jwt, tenants={**KEYS, "list": TEAMS}))
    assert message.startswith("spec.tenants.keysFile: not with spec.auth.jwt")


def test_a_number_given_as_text_is_a_config_error_not_a_crash() -> None:
    # `int | float` fields once raised AttributeError while wording the error.
    sched = {"name": "a", "modelName": "m", "endpoints": ["h:1"], "weights": {"queue": "2"}}
    with pytest.raises(ConfigError, match=r"weights\.queue: expected int or float, got str"):
        parse_config(doc(schedulers=[sched]))
