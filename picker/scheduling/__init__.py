"""Request-path scheduling: filters → scorers → weighted sum → pick, per pool.

Layering (imports only go down): request, state, prefix_index, context →
plugins (the Filter, Scorer and Picker interfaces and their registries) →
filters → scorers/*, and pickers (each plugin registers under its type name) →
profiles (plugin names, resolved once per configuration) → scheduler;
saturation → admission. The director owns one `Scheduler` and one
`AdmissionQueue` per pool. Adding a plugin: docs/extending.md.
"""

from picker.scheduling.admission import AdmissionQueue
from picker.scheduling.errors import NoCandidates
from picker.scheduling.prefix_index import PrefixIndex
from picker.scheduling.profiles import PROFILES, build_profile
from picker.scheduling.request import SchedulingRequest
from picker.scheduling.saturation import pool_saturated
from picker.scheduling.scheduler import Pick, Scheduler

__all__ = [
    "PROFILES",
    "AdmissionQueue",
    "NoCandidates",
    "Pick",
    "PrefixIndex",
    "Scheduler",
    "SchedulingRequest",
    "build_profile",
    "pool_saturated",
]
