"""A flag that sets a config field takes its default from the field (written once): with no
flags given, the configs the settings build equal the dataclasses' own defaults."""

from __future__ import annotations

import argparse
import dataclasses

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.app.settings.router import add_router_flags, router_config
from pdserve.app.settings.workers import add_decode_flags, decode_config
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
        if field.name not in NOT_FLAG_DEFAULTS:
            assert getattr(built, field.name) == getattr(default, field.name), field.name


def test_engine_flag_defaults_are_the_config_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_decode_flags(parser, {})
    engine = decode_config(parser.parse_args(["--model", "m"])).engine
    assert engine == EngineConfig(model="m", cache=CacheConfig(), scheduler=SchedulerConfig())
