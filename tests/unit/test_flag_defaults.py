"""A flag that sets a config field takes its default from the field (written once): with no
flags given, the configs the settings build equal the dataclasses' own defaults."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from app import settings
from app.settings.router import add_router_flags, router_config
from app.settings.workers import add_decode_flags, decode_config
from decode_service.config import DecodeConfig
from engine.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpecMethod,
    SpeculativeConfig,
)
from engine.dtype_choice import AUTO, resolve_dtype
from pdserve.common.role import Role
from pdserve.common.server import ServerConfig
from prefill_service.config import PrefillConfig
from router.config import RouterConfig

# Set from elsewhere than a flag default of the field's own (addresses, the server section).
NOT_FLAG_DEFAULTS = {"model", "prefill_addresses", "decode_addresses", "server", "redis"}


def test_router_flag_defaults_are_the_config_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_router_flags(parser, {})
    args = parser.parse_args(["--model", "m", "--prefill", "p:1", "--decode", "d:1"])
    built = router_config(args)
    default = RouterConfig(model="m", prefill_addresses=("p:1",), decode_addresses=("d:1",))
    for field in dataclasses.fields(RouterConfig):
        if field.name not in NOT_FLAG_DEFAULTS | {"layout"}:
            assert getattr(built, field.name) == getattr(default, field.name), field.name
    # A layout holds a resolved dtype; the flag's default is auto, resolved for the model on
    # this machine (as the workers' EngineConfig resolves its own default).
    auto = dataclasses.replace(default.layout, dtype=resolve_dtype(AUTO, "m"))
    assert built.layout == auto
    assert auto.dtype.value == EngineConfig(model="m").dtype


def test_engine_flag_defaults_are_the_config_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_decode_flags(parser, {})
    engine = decode_config(parser.parse_args(["--model", "m"])).engine
    assert engine == EngineConfig(model="m", cache=CacheConfig(), scheduler=SchedulerConfig())


# A CLI process listens on well-known ports; a config built in code asks for ephemeral ones.
WELL_KNOWN_PORTS = {"port", "kv_port"}


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE], ids=lambda r: r.value)
def test_worker_and_server_flag_defaults_are_the_config_defaults(role: Role) -> None:
    built = settings.parse_service_flags(role, ["--model", "m"])
    assert isinstance(built, PrefillConfig | DecodeConfig)
    default = type(built)(engine=built.engine)
    for field in dataclasses.fields(built):
        if field.name not in {"engine", "server"} | WELL_KNOWN_PORTS:
            assert getattr(built, field.name) == getattr(default, field.name), field.name
    for field in dataclasses.fields(ServerConfig):
        if field.name not in WELL_KNOWN_PORTS:
            assert getattr(built.server, field.name) == getattr(ServerConfig(), field.name)


def test_speculative_flag_defaults_are_the_config_defaults() -> None:
    built = settings.parse_service_flags(
        Role.DECODE, ["--model", "m", "--speculative-method", "ngram"]
    )
    assert isinstance(built, DecodeConfig)
    assert built.engine.speculative == SpeculativeConfig(SpecMethod.NGRAM)
