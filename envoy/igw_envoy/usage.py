"""Output tokens per response, measured by Envoy and reported to the picker (spec.tenants).

The picker sees requests only; what a response generated is counted here, on the
response path, by a Lua filter that reads the stream as it passes without holding
it (`bodyChunks` does not buffer):
- a `usage` object in the response (every non-streamed answer, the last event of a
  stream with `stream_options.include_usage`, every event with vLLM's
  `continuous_usage_stats`): its `completion_tokens`, exact, the last one seen;
- a stream without one: its `data: {` events less those that carry no output (the
  opening role event, a closing event with an empty delta or text, in the formats of
  tests/fixtures/sse), flagged as an estimate: an engine may put more than one token
  in an event.
The filter is igw_envoy.http_filters' `usage_filter`. The count goes into the
`igw.usage` dynamic metadata, and Envoy's gRPC access log sends the entries that
have one to the picker in batches (picker.access_log), so nothing is added to the
request path but the Lua filter's scan of each chunk. A `"completion_tokens"` key
can only be JSON structure (a quote inside a JSON string is escaped), never
generated text. Compressed or non-200 responses are not counted: the reservation
stands for them.
"""

from __future__ import annotations

from contract import headers
from contract.config import GatewayConfig
from igw_envoy.clusters import PICKER_CLUSTER

GRPC_LOG_TYPE = (
    "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig"
)
# Envoy's batch flush: how late a correction arrives, against batches per second.
FLUSH_INTERVAL = "0.2s"
FLUSH_BYTES = 16384

# `tail` keeps the previous chunk's last bytes, so a key or a marker split between two
# chunks is still seen; a marker is counted once, in the chunk where it ends.
USAGE_LUA = """
local NS = "NAMESPACE"
local TAIL = 64
-- An event that carries no output: the opening role event, a closing event with an empty
-- delta or text (vLLM 0.5 / 0.9 / 0.15: tests/fixtures/sse; `{}` as OpenAI closes, pasted
-- in sashabaranov/go-openai issue #398). A closing event that carries the last token
-- (vLLM's finish_reason "length") is not one of them.
local EMPTY = {
  '"delta":{}', '"delta":{"role":"assistant"}', '"delta":{"content":""}',
  '"delta":{"role":"assistant","content":""}', '"text":""',
}

-- occurrences of `marker` in `text` that end after position `seen` (not counted before)
local function count(text, marker, seen)
  local n, at = 0, math.max(1, seen - #marker + 2)
  while true do
    local found = string.find(text, marker, at, true)
    if found == nil then
      return n
    end
    n = n + 1
    at = found + #marker
  end
end

function envoy_on_response(handle)
  local h = handle:headers()
  if h:get(":status") ~= "200" or h:get("content-encoding") ~= nil then
    return
  end
  local stream = string.find(h:get("content-type") or "", "text/event-stream", 1, true) ~= nil
  local tail, events, empty, reported = "", 0, 0, nil
  for chunk in handle:bodyChunks() do
    local size = chunk:length()
    if size > 0 then
      local text = tail .. chunk:getBytes(0, size)
      if stream then
        events = events + count(text, "data: {", #tail)
        for _, marker in ipairs(EMPTY) do
          empty = empty + count(text, marker, #tail)
        end
      end
      if string.find(text, '"completion_tokens"', 1, true) then
        for value in string.gmatch(text, '"completion_tokens"%s*:%s*(%d+)') do
          reported = value
        end
      end
      if #text > TAIL then
        tail = string.sub(text, -TAIL)
      else
        tail = text
      end
    end
  end
  local meta = handle:streamInfo():dynamicMetadata()
  if reported ~= nil then
    meta:set(NS, "OUTPUT", tonumber(reported))
    meta:set(NS, "EXACT", true)
  elseif stream and events > 0 then
    meta:set(NS, "OUTPUT", math.max(0, events - empty))
    meta:set(NS, "EXACT", false)
  end
end
""".replace("NAMESPACE", headers.USAGE_METADATA_NAMESPACE).replace(
    "OUTPUT", headers.OUTPUT_TOKENS_KEY
).replace("EXACT", headers.USAGE_EXACT_KEY)


def measures_usage(config: GatewayConfig) -> bool:
    """spec.tenants with `measureUsage` (the default): the filter, the log, the ledger."""
    return config.tenants is not None and config.tenants.measure_usage


def usage_access_log() -> dict:
    """Envoy's gRPC access log to the picker, for the entries the Lua filter measured
    (`match_if_key_not_found: false`: without the key, no entry)."""
    return {
        "name": "envoy.access_loggers.http_grpc",
        "filter": {
            "metadata_filter": {
                "matcher": {
                    "filter": headers.USAGE_METADATA_NAMESPACE,
                    "path": [{"key": headers.OUTPUT_TOKENS_KEY}],
                    "value": {"present_match": True},
                },
                "match_if_key_not_found": False,
            }
        },
        "typed_config": {
            "@type": GRPC_LOG_TYPE,
            "common_config": {
                "log_name": "igw-usage",
                "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}},
                "transport_api_version": "V3",
                "buffer_flush_interval": FLUSH_INTERVAL,
                "buffer_size_bytes": FLUSH_BYTES,
            },
        },
    }
