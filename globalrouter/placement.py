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

    cheapest-within-slo  regions predicted to meet the TTFT SLO (the summary's
                         predicted TTFT + the measured RTT), cheapest first
                         (ties: faster first), then the rest, fastest first
    fastest              fastest first

Affinity (globalrouter.affinity) enters twice. A prefix the router sent to a
region before makes that region's prediction shorter by the matched share of the
prompt, when nothing waits there, before the policy orders. A session's region
is then moved to the front if it is neither saturated nor suspect and its prediction meets the
SLO: a conversation stays while its region is good enough, whatever the policy
would pick for a new one.

All of it is numpy over a few regions; nothing here waits or allocates per region.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from contract.errors import NoEligibleRegion, echo
from contract.global_config import ModelPolicy
from globalrouter.regions import ModelView, RegionTable


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
    session_row: int = -1,
    cached: np.ndarray | None = None,
) -> Placement:
    """Up to `count` regions for `model`, best first; NoEligibleRegion when none may.

    `session_row`: the region of the request's session (-1: none); `cached`: per
    region, the share of the prompt it holds (None: nowhere)."""
    keep = table.fresh(now)
    _require(keep, f"no region has a fresh load summary for model `{echo(model)}`")
    keep = keep & view.serves & view.ready
    _require(keep, f"no healthy region has a ready pod for model `{echo(model)}`")
    keep &= ~table.drained
    _require(keep, f"every region serving model `{echo(model)}` is drained")
    residency = table.residency_mask(policy)
    if residency is not None:
        keep &= residency
        _require(keep, f"no region with residency {', '.join(policy.residency)} can serve "
                       f"model `{echo(model)}` now")
    if allowed is not None:
        keep &= allowed
        _require(keep, f"no region allowed by x-gateway-regions "
                       f"({echo(allow_header or '', 100)!r}) can serve model `{echo(model)}` now")
    rows = np.flatnonzero(keep)
    ttft = view.ttft_s[rows]
    if cached is not None:  # a cached prefix shortens the prefill, not a queue
        ttft = ttft * (1.0 - np.where(view.waiting[rows], 0.0, cached[rows]))
    ttft = ttft + table.rtt_s[rows]
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
        meets_slo=first <= policy.ttft_slo_s,
        affinity=affinity,
    )


def _require(mask: np.ndarray, message: str) -> None:
    if not mask.any():
        raise NoEligibleRegion(message)


def _order(ttft: np.ndarray, spilled: np.ndarray, suspect: np.ndarray, cost: np.ndarray,
           policy: ModelPolicy) -> np.ndarray:
    """Positions into the eligible rows, best first (see the module docstring)."""
    if policy.policy == "fastest":
        return np.lexsort((ttft, spilled, suspect))
    misses = ttft > policy.ttft_slo_s
    # within the SLO: by cost; beyond it: cost does not matter, speed does
    cost = np.where(misses, 0.0, cost)
    return np.lexsort((ttft, cost, misses, spilled, suspect))


def _keep_session(order: np.ndarray, rows: np.ndarray, session_row: int, ttft: np.ndarray,
                  passed_over: np.ndarray, policy: ModelPolicy) -> tuple[np.ndarray, str]:
    """The session's region first if it qualifies (not saturated nor suspect, predicted
    within the SLO); the order and what affinity did."""
    at = np.flatnonzero(rows == session_row)
    if at.size == 0 or passed_over[at[0]] or ttft[at[0]] > policy.ttft_slo_s:
        return order, "moved"
    pos = at[0]
    return np.concatenate((at, order[order != pos])), "session"
