"""The hand-assembled body answer is exactly the message protobuf would build."""

from __future__ import annotations

from types import SimpleNamespace

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

from picker.handlers import route_response


def test_route_response_wire_format():
    headers = [("x-gateway-pool", "llama"),
               ("x-gateway-destination-endpoint", "10.0.0.1:8000,10.0.0.2:8000"),
               ("x-gateway-model-name", "sql-lora" * 40)]  # a value longer than 127 bytes
    wire = route_response(SimpleNamespace(headers=headers))
    parsed = ext_proc.ProcessingResponse.FromString(wire)
    expected = ext_proc.ProcessingResponse(
        request_body=ext_proc.BodyResponse(
            response=ext_proc.CommonResponse(
                header_mutation=ext_proc.HeaderMutation(set_headers=[
                    base_pb2.HeaderValueOption(
                        header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
                    for k, v in headers]),
                clear_route_cache=True)))
    assert parsed == expected
    assert wire == expected.SerializeToString()
