"""The committed stubs in proto/ are exactly what proto/generate.py makes from the .proto,
and they import as loraplex.proto.* (package-relative, not a top-level ``loraplex_pb2``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from loraplex.proto import generate

pytest.importorskip("grpc_tools")


def test_committed_stubs_match_regeneration(tmp_path: Path) -> None:
    written = generate.generate(tmp_path)
    assert [p.name for p in written] == list(generate.STUBS)
    stale = [p.name for p in written
             if p.read_text() != (generate.PROTO_DIR / p.name).read_text()]
    assert not stale, (f"{stale} differ from proto/loraplex.proto: run "
                       "`python -m loraplex.proto.generate` and commit the result")


def test_grpc_stub_imports_relatively() -> None:
    text = (generate.PROTO_DIR / "loraplex_pb2_grpc.py").read_text()
    assert "from . import loraplex_pb2 as loraplex__pb2" in text
    assert "\nimport loraplex_pb2" not in text
    from loraplex.proto import loraplex_pb2_grpc

    assert "loraplex_pb2" not in sys.modules  # no top-level twin was imported
    assert hasattr(loraplex_pb2_grpc, "InferenceStub")


def test_contract_names() -> None:
    """docs/contracts.md's service, RPC and field names: renaming any breaks clients."""
    from loraplex.proto import loraplex_pb2 as pb

    services = pb.DESCRIPTOR.services_by_name
    assert pb.DESCRIPTOR.package == "loraplex.v1"
    assert set(services["Inference"].methods_by_name) == {"Generate", "GenerateStream"}
    assert set(services["AdapterAdmin"].methods_by_name) == {
        "LoadAdapter", "UnloadAdapter", "ListAdapters", "UploadAdapter", "ResetPrefixCache"}
    upload = services["AdapterAdmin"].methods_by_name["UploadAdapter"]
    assert upload.client_streaming and not upload.server_streaming
    assert set(services["ServerInfo"].methods_by_name) == {"GetServerInfo", "GetStats"}
    assert services["Inference"].methods_by_name["GenerateStream"].server_streaming

    def fields(msg: type) -> set[str]:
        return set(msg.DESCRIPTOR.fields_by_name)

    assert {"request_id", "adapter", "prompt", "prompt_token_ids", "params", "messages"} <= \
        fields(pb.GenerateRequest)
    assert fields(pb.ChatMessage) == {"role", "content"}
    assert {"temperature", "top_p", "top_k", "seed", "max_new_tokens", "min_new_tokens",
            "stop", "stop_token_ids", "ignore_eos"} <= fields(pb.SamplingParams)
    assert {"request_id", "adapter", "text", "token_ids", "finish_reason", "usage"} <= \
        fields(pb.GenerateResponse)
    assert {"prompt_tokens", "completion_tokens"} <= fields(pb.Usage)
    assert {"name", "path", "state", "rank", "target_modules", "size_bytes",
            "active_requests", "pinned", "preloaded"} <= fields(pb.AdapterInfo)
    assert {"name", "path", "replace", "pin"} <= fields(pb.LoadAdapterRequest)
    assert fields(pb.UploadAdapterRequest) == {"header", "chunk"}
    assert {"name", "adapter_config", "replace", "pin", "size_bytes"} <= \
        fields(pb.UploadAdapterHeader)
    assert "version" in fields(pb.AdapterInfo)
    for msg in (pb.GenerateResponse, pb.GenerateStreamResponse):
        assert msg.DESCRIPTOR.fields_by_name["adapter_version"].has_presence
    assert fields(pb.UnloadAdapterRequest) == {"name"}
    assert fields(pb.ListAdaptersResponse) == {"adapters"}
    assert set(pb.AdapterInfo.State.keys()) >= {"ON_DISK", "LOADING", "ON_CPU", "ON_DEVICE",
                                                "FAILED"}
    # sampling fields with a model default have presence: unset != 0
    for name in ("temperature", "top_p", "top_k", "seed", "max_new_tokens"):
        assert pb.SamplingParams.DESCRIPTOR.fields_by_name[name].has_presence
    # unset lora_scale is 1 (the adapter as trained), not 0 (the base model)
    assert pb.SamplingParams.DESCRIPTOR.fields_by_name["lora_scale"].has_presence


def test_messages_pickle_under_their_module_name() -> None:
    """Ray Serve's gRPC proxy pickles every request: the messages must name a module pickle
    can import (loraplex.proto.loraplex_pb2, not a top-level loraplex_pb2)."""
    import pickle

    from loraplex.proto import loraplex_pb2 as pb

    assert pb.GenerateRequest.__module__ == "loraplex.proto.loraplex_pb2"
    msg = pb.GenerateRequest(adapter="sql", prompt="hi", params=pb.SamplingParams(top_k=3))
    assert pickle.loads(pickle.dumps(msg)) == msg
    info = pb.AdapterInfo(name="a", replicas=[pb.ReplicaAdapter(replica="r1", state=4)])
    assert pickle.loads(pickle.dumps(info)) == info
