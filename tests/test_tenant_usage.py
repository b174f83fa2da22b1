"""The usage ledger (picker.tenants.usage) and the access log stream that feeds it
(picker.access_log), on their own: the join by request id in either order, the
corrections, the bounds, and what a malformed batch does (nothing). Envoy's side
is tests/test_usage_lua.py; the whole path tests/test_tenants_gateway.py."""

from __future__ import annotations

from envoy.config.core.v3 import base_pb2
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2
from google.protobuf import struct_pb2

from contract.config import RateLimits
from contract.headers import USAGE_METADATA_NAMESPACE
from picker.access_log import AccessLogStream
from picker.tenants.identity import Tenant
from picker.tenants.limits import Limiter
from picker.tenants.usage import UsageLedger

T0 = 600.0  # inside window 10 of 60 s


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tokens_left(lim: Limiter) -> int:
    return lim.keys["a"][""].tokens.remaining(10, 0.0)


def setup(**kw) -> tuple[UsageLedger, Limiter, Tenant, Clock]:
    lim = Limiter(clock=lambda: T0, wall_offset=0.0)
    lim.configure({("a", ""): RateLimits(tokens_per_minute=1000)})
    clock = Clock()
    return UsageLedger(lim, clock=clock, **kw), lim, Tenant("a", 1.0), clock


def test_measured_after_the_end_counts_and_corrects() -> None:
    ledger, lim, tenant, _ = setup()
    grant = lim.admit("a", "m", 10 + 500, T0)  # prompt 10 + max_tokens 500
    ledger.opened("r1", tenant, grant, 10)
    assert tokens_left(lim) == 490
    lim.release(grant)
    ledger.ended("r1")
    assert ledger.measured("r1", 40, exact=True)
    assert tokens_left(lim) == 1000 - 50
    assert (tenant.usage.output_tokens, tenant.usage.output_tokens_estimated) == (40, 0)
    assert not ledger.measured("r1", 40, exact=True)  # once
    assert len(ledger) == 0


def test_measured_before_the_end_and_estimates_flagged() -> None:
    ledger, lim, tenant, _ = setup()
    grant = lim.admit("a", "m", 110, T0)
    ledger.opened("r1", tenant, grant, 10)
    assert ledger.measured("r1", 7, exact=False)  # the log beat the ext_proc close
    ledger.ended("r1")  # nothing left to wait for
    assert len(ledger) == 0
    assert tokens_left(lim) == 1000 - 17
    assert tenant.usage.output_tokens_estimated == 7


def test_unknown_ids_and_requests_without_an_id_are_ignored() -> None:
    ledger, _, tenant, _ = setup()
    ledger.opened("", tenant, None, 10)
    assert len(ledger) == 0
    assert not ledger.measured("nobody", 5, exact=True)
    ledger.ended("nobody")
    assert tenant.usage.output_tokens == 0


def test_a_request_whose_count_never_comes_is_dropped_after_the_linger() -> None:
    ledger, lim, tenant, clock = setup(linger_s=10.0)
    grant = lim.admit("a", "m", 110, T0)
    ledger.opened("r1", tenant, grant, 10)
    ledger.opened("r2", tenant, None, 10)  # still streaming: never swept
    ledger.ended("r1")
    clock.now = 9.0
    assert ledger.sweep() == 0
    clock.now = 10.5
    assert ledger.sweep() == 1
    assert ledger.unmeasured == 1
    assert not ledger.measured("r1", 5, exact=True)
    assert tokens_left(lim) == 1000 - 110  # the reservation stands
    assert len(ledger) == 1


def test_bounds_drop_the_oldest() -> None:
    ledger, _, tenant, _ = setup(max_open=2, max_ended=1)
    for rid in ("r1", "r2", "r3"):
        ledger.opened(rid, tenant, None, 1)
    assert not ledger.measured("r1", 1, exact=True)
    ledger.ended("r2")
    ledger.ended("r3")
    assert len(ledger) == 1 and ledger.unmeasured == 2
    assert ledger.measured("r3", 1, exact=True)


class Sent:
    def __init__(self) -> None:
        self.messages: list[bytes] = []
        self.finished = False

    def send(self, message: bytes) -> None:
        self.messages.append(message)

    def finish(self) -> None:
        self.finished = True


def entry(request_id: str, fields: dict | None) -> accesslog_pb2.HTTPAccessLogEntry:
    out = accesslog_pb2.HTTPAccessLogEntry()
    out.request.request_id = request_id
    if fields is not None:
        meta = struct_pb2.Struct()
        meta.update(fields)
        out.common_properties.metadata.CopyFrom(
            base_pb2.Metadata(filter_metadata={USAGE_METADATA_NAMESPACE: meta}))
    return out


def test_access_log_batches_reach_the_ledger_and_garbage_is_dropped() -> None:
    ledger, _, tenant, _ = setup()
    for rid in ("r1", "r2", "r3"):
        ledger.opened(rid, tenant, None, 1)
    sent = Sent()
    stream = AccessLogStream(ledger, sent)  # type: ignore[arg-type]
    batch = als_pb2.StreamAccessLogsMessage()
    batch.http_logs.log_entry.extend([
        entry("r1", {"output_tokens": 12, "exact": True}),
        entry("r2", {"output_tokens": 3}),  # no flag: an estimate
        entry("r3", None),  # no count: nothing measured
        entry("other", {"output_tokens": 99, "exact": True}),
    ])
    stream.on_message(batch.SerializeToString())
    stream.on_message(b"\xff\xff not protobuf")
    assert (tenant.usage.output_tokens, tenant.usage.output_tokens_estimated) == (15, 3)
    assert len(ledger) == 1  # r3 waits for its end and the linger
    stream.on_end(reset=False)
    assert sent.finished and sent.messages == [b""]
