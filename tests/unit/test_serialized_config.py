"""``settings/serialized.py``: a component's whole config as JSON (what ``pdserve up`` hands a
child on stdin) comes back equal, validated again; bad input is a named ValueError."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from app import settings
from pdserve.common.role import Role

REDIS = ["--redis", "redis://127.0.0.1:6399/0", "--redis-namespace", "ns"]
FLAGS = {
    Role.ROUTER: [
        "--model",
        "/m",
        "--colocated",
        "--http-port",
        "0",
        "--prefill-policy",
        "round_robin",
        "--kv-cache-dtype",
        "int8",
        "--migration-limit",
        "2",
        *REDIS,
    ],
    Role.PREFILL: [
        "--model",
        "/m",
        "--dtype",
        "bfloat16",
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--host-cache-gib",
        "1.5",
        "--kv-port",
        "0",
        "--lease-s",
        "12",
        "--kv-stores",
        "127.0.0.1:3",
        "--kv-store-replicas",
        "2",
        *REDIS,
    ],
    Role.KVSTORE: [
        "--model",
        "/m",
        "--capacity-gib",
        "2.5",
        "--kv-cache-dtype",
        "int8",
        "--kv-port",
        "0",
        *REDIS,
    ],
    Role.DECODE: [
        "--model",
        "/m",
        "--prefill-peers",
        "127.0.0.1:1,127.0.0.1:2",
        "--max-num-seqs",
        "7",
        "--metrics-port",
        "0",
        "--worker-id",
        "d-1",
        "--speculative-method",
        "ngram",
        "--num-speculative-tokens",
        "3",
    ],
}


@pytest.mark.parametrize("role", list(Role), ids=lambda r: r.value)
def test_every_role_round_trips_equal(role: Role) -> None:
    config = settings.parse_service_flags(role, FLAGS[role])
    text = settings.to_json(config)
    assert settings.from_json(text) == config
    assert settings.role_of(settings.from_json(text)) is role


def test_the_defaults_round_trip_too() -> None:
    config = settings.parse_service_flags(Role.DECODE, ["--model", "/m"])
    assert settings.from_json(settings.to_json(config)) == config


def _decode_json() -> dict[str, object]:
    config = settings.parse_service_flags(Role.DECODE, ["--model", "/m"])
    raw = json.loads(settings.to_json(config))
    assert isinstance(raw, dict)
    return raw


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda c: c["engine"]["scheduler"].update(max_num_seqs="8"),
            "config.engine.scheduler.max_num_seqs: expected int",
        ),
        (lambda c: c["engine"].update(colour=1), "unknown field 'colour' of EngineConfig"),
        (lambda c: c["server"].pop("port"), "missing field 'port' of ServerConfig"),
        (lambda c: c["engine"]["cache"].update(kv_cache_dtype="fp4"), "is not a KVCacheDtype"),
        (lambda c: c["engine"]["cache"].update(block_size=0), "block_size"),  # its own check
        (lambda c: c.update(prefill_peers="a:1"), "config.prefill_peers: expected a list"),
    ],
)
def test_bad_fields_are_named(change: object, message: str) -> None:
    raw = _decode_json()
    change(raw["config"])  # type: ignore[operator]
    with pytest.raises(ValueError, match=message):
        settings.from_json(json.dumps(raw))


@pytest.mark.parametrize("text", ["", "[]", '{"role": "cook", "config": {}}', '{"role": "router"}'])
def test_what_is_no_config_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a serialized pdserve config"):
        settings.from_json(text)


def test_a_child_refuses_a_bad_config_on_stdin_and_exits_non_zero() -> None:
    raw = _decode_json()
    raw["config"]["engine"] = 1  # type: ignore[index]
    child = subprocess.run(
        [sys.executable, "-m", "app", "serve-config"],
        input=json.dumps(raw),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode != 0
    assert "config.engine: expected an object" in child.stderr
