"""The plugin registries against everything that names a plugin or a profile.

The config layer (contract) sits below the picker and cannot import its
registries, so it keeps its own name tuples; these tests hold the two equal.
"""

from __future__ import annotations

from dataclasses import fields
from typing import ClassVar

import pytest

from bench.routers import ROUTERS
from contract.config import SCHEDULER_PROFILES, WEIGHT_NAMES, SchedulerConfig
from picker.scheduling.plugins import (
    FILTERS,
    PICKERS,
    SCORERS,
    DuplicatePlugin,
    Registry,
    UnknownPlugin,
)
from picker.scheduling.profiles import DEFAULT_PROFILE, PROFILES, ProfileSpec, build_profile
from picker.scheduling.scheduler import DEGRADED_PROFILE

# -- the config's names are the registries' -------------------------------------------


def test_config_weight_names_are_the_user_weightable_scorers():
    assert sorted(WEIGHT_NAMES) == sorted(SCORERS.public_names())


def test_least_request_is_a_scorer_but_not_a_weight():
    """Only the least-request baseline and degraded mode use it; a config cannot weight it."""
    assert "leastRequest" in SCORERS
    assert "leastRequest" not in SCORERS.public_names()
    assert "leastRequest" not in WEIGHT_NAMES


def test_config_profile_names_are_the_profiles():
    assert tuple(PROFILES) == SCHEDULER_PROFILES


def test_every_other_profile_name_is_a_profile():
    default = next(f.default for f in fields(SchedulerConfig) if f.name == "scheduler")
    assert default == DEFAULT_PROFILE
    assert DEGRADED_PROFILE in PROFILES
    igw = {spec.policy for spec in ROUTERS.values() if spec.kind == "igw"}
    assert igw <= set(PROFILES)


# -- every profile resolves --------------------------------------------------------------


@pytest.mark.parametrize("name", list(PROFILES))
def test_every_profile_names_registered_plugins(name):
    spec = PROFILES[name]
    assert set(spec.filters) <= set(FILTERS)
    assert spec.picker in PICKERS
    assert set(spec.weights) | set(spec.params) <= set(SCORERS)
    profile = build_profile(name)
    assert [f.name for f in profile.filters] == list(spec.filters)
    assert profile.picker.name == spec.picker
    assert profile.weights == {k: v for k, v in spec.weights.items() if v > 0}


@pytest.mark.parametrize("name", [n for n, spec in PROFILES.items() if spec.accepts_weights])
def test_profiles_that_take_the_configs_weights_use_only_weightable_scorers(name):
    """Else a profile would run a scorer the user cannot turn off or retune."""
    assert set(PROFILES[name].weights) <= set(SCORERS.public_names())


def test_every_registered_plugin_is_named_as_it_registered():
    for registry in (FILTERS, SCORERS, PICKERS):
        for name in registry:
            assert registry[name].name == name


# -- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("registry", "name"),
    [(FILTERS, "ready"), (SCORERS, "queue"), (PICKERS, "max-score")],
    ids=["filter", "scorer", "picker"],
)
def test_registering_a_taken_name_is_an_error(registry, name):
    original = registry[name]

    class Impostor:
        pass

    Impostor.name = name  # type: ignore[attr-defined]
    with pytest.raises(DuplicatePlugin, match=f"{registry.kind} '{name}' registered twice"):
        registry.register(Impostor)
    with pytest.raises(DuplicatePlugin):
        registry.register_internal(Impostor)
    assert registry[name] is original


def test_a_new_registry_takes_distinct_names_and_keeps_their_order():
    registry: Registry[object] = Registry("thing")

    class A:
        name: ClassVar[str] = "a"

    class B:
        name: ClassVar[str] = "b"

    assert registry.register(B) is B
    assert registry.register_internal(A) is A
    assert list(registry) == ["b", "a"]
    assert registry.public_names() == ("b",)
    with pytest.raises(UnknownPlugin, match="unknown thing 'c'; known: b, a"):
        registry["c"]


def test_unknown_names_in_a_profile_fail_at_build_time_naming_the_known_ones(monkeypatch):
    with pytest.raises(ValueError, match=r"unknown scorer 'bogus'; known: .*queue"):
        build_profile("llm-d", {"bogus": 1.0})
    monkeypatch.setitem(PROFILES, "broken", ProfileSpec(weights={}, filters=("ready", "nope")))
    with pytest.raises(ValueError, match="unknown filter 'nope'; known: ready, not-draining"):
        build_profile("broken")
    monkeypatch.setitem(PROFILES, "broken", ProfileSpec(weights={}, picker="best"))
    with pytest.raises(ValueError, match="unknown picker 'best'; known: max-score"):
        build_profile("broken")
