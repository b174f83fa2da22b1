"""Placement: which regions may take a request (filters), and in which order (policy).

Filters are masks over the regions, applied in a fixed order; the first that
leaves no region names the constraint in the 503 (`NoEligibleRegion`):

    fresh        the region's summary is fresh (its last poll succeeded, not stale)
    serves       a pool of the region serves the model and has a ready pod
    not-drained  the operator did not drain the region (spec.regions[].drain)
    residency    the model's policy allows the region's `residency` tag
    allow-list   the client's `x-gateway-regions` names it (it can only narrow)

Then the order, which Envoy follows on retries (the n-th attempt goes to the
n-th region, igw_envoy.global_front): regions not suspect first (a region whose
last poll failed or was slow, or whose poll is overdue, RegionTable.suspect),
then regions below the spill-over saturation before saturated ones (spill-over),
each group by the policy:

    cheapest-within-slo  regions predicted to meet the TTFT SLO with
                         `SLO_HEADROOM` to spare, cheapest first (ties: faster
                         first), then the rest, fastest first
    fastest              fastest first

The prediction per region (`predict`): the summary's predicted TTFT of a
typical request, plus what differs for this one at the region's prefill speed
(its own prompt against the typical one; the prompt tokens the router placed
there since the summary's poll left, spread over the ready pods), plus the
measured RTT. A summary without a prefill speed (an older Tier 1) gives the
typical prediction + RTT alone.

Affinity (globalrouter.affinity) enters twice. A prefix the router sent to a
region before takes its matched share of this prompt off the prediction, when
nothing waits there (at the region's prefill speed; without one, that share of
the predicted TTFT), before the policy orders. A session's region
is then moved to the front if it is neither saturated nor suspect and its prediction meets the
SLO: a conversation stays while its region is good enough, whatever the policy
would pick for a new one.

All of it is numpy over a few regions; nothing here waits or allocates per region.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn

import numpy as np

from contract.errors import NoEligibleRegion, echo
from contract.global_config import ModelPolicy
from globalrouter.regions import ModelView, RegionTable

# Share of the SLO kept free for prediction error: a region counts as meeting the SLO
# when predicted within (1 - SLO_HEADROOM) x SLO. The summary is up to a poll interval
# old and the prediction is for a model of the pod, not the pod (bench/results/
# global-cost.md; docs/benchmarks.md has what else was tried).
SLO_HEADROOM = 0.15


@dataclass(frozen=True, slots=True)
class Placement:
    """The regions to try, best first (rows of the table), and what was predicted."""

    rows: tuple[int, ...]
    names: tuple[str, ...]
    addresses: tuple[str, ...]
    predicted_ttft_s: float  # of the first region: its summary's prediction + RTT
    meets_slo: bool
    # What affinity did: "session" (the session's region kept it), "moved" (the session's
    # region no longer qualified), "prefix" (the first region holds part of the prompt), "".
    affinity: str = ""


def allow_list(table: RegionTable, header: str | None) -> np.ndarray | None:
    """The client's `x-gateway-regions: a,b` as a mask (None: no header, no constraint).

    Unknown names allow nothing (an allow-list naming only unknown regions is empty,
    a 503 naming it, never a silent widening); spaces around names are ignored.
    """
    if header is None:
        return None
    mask = np.zeros(len(table), dtype=bool)
    for name in header.split(","):
        row = table.index.get(name.strip())
        if row is not None:
            mask[row] = True
    return mask


def place(
    table: RegionTable,
    model: str,
    view: ModelView,
    policy: ModelPolicy,
    allowed: np.ndarray | None,
    now: float,
    count: int,
    allow_header: str | None = None,
    prompt_tokens: int | None = None,
    session_row: int = -1,
    cached: np.ndarray | None = None,
) -> Placement:
    """Up to `count` regions for `model`, best first; NoEligibleRegion when none may.

    `prompt_tokens`: this request's (None: predict for a typical one); `session_row`:
    the region of the request's session (-1: none); `cached`: per region, the share of
    the prompt it holds (None: nowhere)."""
    keep = table.fresh(now)
    if not keep.any():
        _refuse(f"no region has a fresh load summary for model `{echo(model)}`")
    keep = keep & view.serves & view.ready
    if not keep.any():
        _refuse(f"no healthy region has a ready pod for model `{echo(model)}`")
    keep &= ~table.drained
    if not keep.any():
        _refuse(f"every region serving model `{echo(model)}` is drained")
    residency = table.residency_mask(policy)
    if residency is not None:
        keep &= residency
        if not keep.any():
            _refuse(f"no region with residency {', '.join(policy.residency)} can serve "
                    f"model `{echo(model)}` now")
    if allowed is not None:
        keep &= allowed
        if not keep.any():
            _refuse(f"no region allowed by x-gateway-regions "
                    f"({echo(allow_header or '', 100)!r}) can serve model `{echo(model)}` now")
    rows = np.flatnonzero(keep)
    ttft = predict(table, model, view, rows, prompt_tokens, cached)
    spilled = (view.saturation[rows] >= table.config.spill_saturation) | view.saturated[rows]
    suspect = table.suspect(now)[rows]
    order = _order(ttft, spilled, suspect, view.cost[rows], policy)
    affinity = ""
    if session_row >= 0:
        order, affinity = _keep_session(order, rows, session_row, ttft, spilled | suspect,
                                        policy)
    order = order[:count]
    if not affinity and cached is not None and cached[rows[order[0]]] > 0:
        affinity = "prefix"
    chosen = rows[order]
    first = float(ttft[order[0]])
    return Placement(
        rows=tuple(int(r) for r in chosen),
        names=tuple(table.names[r] for r in chosen),
        addresses=tuple(table.addresses[r] for r in chosen),
        predicted_ttft_s=first,
        meets_slo=first <= _slo(policy),
        affinity=affinity,
    )


def predict(table: RegionTable, model: str, view: ModelView, rows: np.ndarray,
            prompt_tokens: int | None, cached: np.ndarray | None = None) -> np.ndarray:
    """Predicted TTFT at the client of this request on each of `rows` (the module
    docstring says what is in it). `cached`: per region, the share of the prompt it
    holds; it shortens the prefill, not a queue, so it counts only where nothing waits."""
    ttft = view.ttft_s[rows]
    tps = view.prefill_tps[rows]
    share = None if cached is None else np.where(view.waiting[rows], 0.0, cached[rows])
    extra = np.zeros(len(rows))
    pending = table.pending_tokens(model)
    if pending is not None:
        extra += pending[rows] / np.maximum(view.ready_pods[rows], 1.0)
    if prompt_tokens is not None:
        typical = view.typical_tokens[rows]
        extra += np.where(typical > 0, prompt_tokens - typical, 0.0)
        if share is not None:
            extra -= prompt_tokens * share
    known = tps > 0
    # without a speed to count tokens at: that share of the typical prediction
    unknown = ttft if share is None else ttft * (1.0 - share)
    ttft = np.where(known, np.maximum(ttft + extra / np.where(known, tps, 1.0), 0.0), unknown)
    return ttft + table.rtt_s[rows]


def _slo(policy: ModelPolicy) -> float:
    """The predicted TTFT a region must stay within to count as meeting the SLO."""
    return policy.ttft_slo_s * (1.0 - SLO_HEADROOM)


def _refuse(message: str) -> NoReturn:
    """A filter left no region (the message is built only then: not per request)."""
    raise NoEligibleRegion(message)


def _order(ttft: np.ndarray, spilled: np.ndarray, suspect: np.ndarray, cost: np.ndarray,
           policy: ModelPolicy) -> np.ndarray:
    """Positions into the eligible rows, best first (see the module docstring)."""
    if policy.policy == "fastest":
        return np.lexsort((ttft, spilled, suspect))
    misses = ttft > _slo(policy)
    # within the SLO: by cost; beyond it: cost does not matter, speed does
    cost = np.where(misses, 0.0, cost)
    return np.lexsort((ttft, cost, misses, spilled, suspect))


def _keep_session(order: np.ndarray, rows: np.ndarray, session_row: int, ttft: np.ndarray,
                  passed_over: np.ndarray, policy: ModelPolicy) -> tuple[np.ndarray, str]:
    """The session's region first if it qualifies (not saturated nor suspect, predicted
    within the SLO); the order and what affinity did."""
    at = np.flatnonzero(rows == session_row)
    if at.size == 0 or passed_over[at[0]] or ttft[at[0]] > _slo(policy):
        return order, "moved"
    pos = at[0]
    return np.concatenate((at, order[order != pos])), "session"
