"""Safe defaults, decided on construction: plaintext only on loopback unless --insecure, TLS
whole or not at all, API keys read from a file (never the command line) and re-read on change;
the public limits are named in their refusals."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import pytest

from app import settings
from engine.sampling_params import SamplingParams
from pdserve.common.auth import ApiKeys, bearer
from pdserve.common.server import ServerConfig
from pdserve.common.tls import TlsConfig, is_loopback
from pdserve.v1 import common_pb2, router_pb2
from router.grpc_wire import invalid_utf8_field, request_from_proto
from router.limits import RequestLimits, check_request
from router.request import Request
from router.request_class import Tenant


def test_plaintext_binds_loopback_only_unless_insecure() -> None:
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "10.0.0.5")] == [
        True, True, True, False, False
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"0\.0\.0\.0 is not a loopback address.*--insecure"):
        ServerConfig(host="0.0.0.0")
    assert ServerConfig(host="0.0.0.0", insecure=True).insecure


def test_tls_is_all_three_files_or_none(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    settings.add_server_flags(parser, 0, env={})
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    half = parser.parse_args(["--tls-cert", str(cert)])
    with pytest.raises(ValueError, match="--tls-cert, --tls-key and --tls-ca together"):
        settings.server_config(half)
    with pytest.raises(ValueError, match=r"key_file .* is not a file"):
        TlsConfig(str(cert), str(tmp_path / "missing"), str(cert))
    both = parser.parse_args(
        [
            "--host",
            "0.0.0.0",
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(cert),
            "--tls-ca",
            str(cert),
        ]
    )
    assert settings.server_config(both).tls == TlsConfig(str(cert), str(cert), str(cert))


def test_api_keys_are_checked_by_digest_and_reread_when_the_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# comment\n\nkey-one\nkey-two\n")
    keys = ApiKeys(path)
    assert keys.allows("Bearer key-one") and keys.allows("bearer key-two")
    for wrong in (None, "", "key-one", "Basic key-one", "Bearer key-three", "Bearer "):
        assert not keys.allows(wrong)
    path.write_text("key-three\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a visibly newer file
    keys._checked_s = 0.0  # the next check looks at the file now (it looks once a second)
    assert keys.allows("Bearer key-three") and not keys.allows("Bearer key-one")
    assert bearer((("x-other", "1"), ("Authorization", "Bearer k"))) == "Bearer k"
    path.write_text("")
    with pytest.raises(ValueError, match="holds no key"):
        ApiKeys(path)


def test_limits_are_checked_by_count_and_bytes_before_anything() -> None:
    limits = RequestLimits(max_prompt_bytes=10, max_stop_strings=2, max_request_bytes=100)
    sampling = common_pb2.SamplingParams(stop=["a", "b", "c"])

    def request(prompt: str, params: SamplingParams) -> Request:
        return Request("r", params, caller="host:127.0.0.1", start_s=0.0, prompt=prompt)

    with pytest.raises(ValueError, match=r"stop has 3 strings, more than --max-stop-strings \(2\)"):
        check_request(request("ok", SamplingParams(stop=["a", "b", "c"])), limits, 64)
    with pytest.raises(ValueError, match=r"prompt has 12 bytes, more than --max-prompt-bytes"):
        check_request(request("\u00e9" * 6, SamplingParams()), limits, 64)
    with pytest.raises(ValueError, match=r"max_prompt_bytes .* must be <= max_request_bytes"):
        RequestLimits(max_prompt_bytes=10, max_request_bytes=5)
    # On the gRPC edge the sizes come first, before a byte of the message is converted.
    hostile = router_pb2.GenerateRequest(
        prompt="ok", sampling=common_pb2.SamplingParams(stop=["a", "b", "c"], temperature=-1.0)
    )
    with pytest.raises(ValueError, match=r"stop has 3 strings"):
        request_from_proto(
            hostile, "r", Tenant("host:127.0.0.1", "host:127.0.0.1"), 0.0, limits, 64
        )
    wire = router_pb2.GenerateRequest(prompt="ok", sampling=sampling).SerializeToString()
    assert invalid_utf8_field(wire) is None
    assert invalid_utf8_field(wire.replace(b"c", b"\xff")) == "stop[2]"
