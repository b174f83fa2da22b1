"""Envoy's gRPC access log (`envoy.service.accesslog.v3.AccessLogService`): how the
picker learns, after a response ended, how many tokens it generated.

Served on the ext_proc port by picker.h2_grpc, as one more method: Envoy opens one
client-streaming call per worker and sends batches of entries (igw_envoy.usage: only
requests whose response a Lua filter measured, flushed every 200 ms). The picker
never answers until Envoy closes the call. Each entry names its request by
x-request-id and carries the count in the `igw.usage` dynamic metadata namespace;
the usage ledger (picker.tenants.usage) does the rest. Nothing here is on the
request path: a batch is parsed once it has arrived, and a malformed one is logged
and dropped, never an error for a request.
"""

from __future__ import annotations

import logging

from envoy.service.accesslog.v3 import als_pb2
from google.protobuf.message import DecodeError

from contract.headers import OUTPUT_TOKENS_KEY, USAGE_EXACT_KEY
from contract.headers import USAGE_METADATA_NAMESPACE as USAGE_NAMESPACE
from picker.h2_grpc import Stream
from picker.tenants.usage import UsageLedger

log = logging.getLogger("picker.access_log")

ACCESS_LOG_PATH = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"
_RESPONSE = als_pb2.StreamAccessLogsResponse().SerializeToString()


class AccessLogStream:
    """One Envoy worker's access log call: every batch to the ledger."""

    __slots__ = ("_ledger", "_stream")
    # Envoy keeps the call open while it runs: a drain must not wait for it (the usage
    # of requests that end during the drain still arrives on it until Envoy stops).
    holds_drain = False

    def __init__(self, ledger: UsageLedger, stream: Stream) -> None:
        self._ledger = ledger
        self._stream = stream

    def on_message(self, message: bytes) -> None:
        try:
            batch = als_pb2.StreamAccessLogsMessage.FromString(message)
        except DecodeError:
            log.warning("access log batch of %d bytes does not parse; dropped", len(message))
            return
        measured = self._ledger.measured
        for entry in batch.http_logs.log_entry:
            namespaces = entry.common_properties.metadata.filter_metadata
            if USAGE_NAMESPACE not in namespaces:
                continue
            fields = namespaces[USAGE_NAMESPACE].fields
            if OUTPUT_TOKENS_KEY not in fields:
                continue
            exact = USAGE_EXACT_KEY in fields and fields[USAGE_EXACT_KEY].bool_value
            measured(entry.request.request_id, int(fields[OUTPUT_TOKENS_KEY].number_value),
                     exact)

    def on_end(self, reset: bool) -> None:
        if not reset:
            self._stream.send(_RESPONSE)
        self._stream.finish()
