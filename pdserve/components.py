"""The serving components built from their flags: what ``pdserve prefill|decode|router``
serves, and what a Ray actor serves from the very same flags."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from pdserve import settings
from pdserve.server import ServerConfig, Service


@dataclass(frozen=True)
class ServiceSpec:
    """One component, built from its flags: what ``pdserve prefill|decode|router`` serves (and
    what a Ray actor serves, from the same flags)."""

    role: str
    service: Service
    server: ServerConfig
    reflect: bool = False


def service_spec(args: argparse.Namespace) -> ServiceSpec:
    if args.command == "router":
        from router.service import RouterService

        router = settings.router_config(args)
        return ServiceSpec("router", RouterService(router), router.server, reflect=True)
    if getattr(args, "kv_backend", "") == "ray":
        connect_ray(args.ray_address)
    if args.command == "prefill":
        from prefill_service.service import PrefillService

        prefill = settings.prefill_config(args)
        return ServiceSpec("prefill", PrefillService(prefill), prefill.server)
    if args.command == "decode":
        from decode_service.service import DecodeService

        decode = settings.decode_config(args)
        return ServiceSpec("decode", DecodeService(decode), decode.server)
    raise ValueError(f"not a service command: {args.command!r}")


def connect_ray(address: str) -> None:
    """Joins a Ray cluster as a driver, unless this process already is in one (a Ray actor)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, namespace="pdserve", logging_level=logging.WARNING)
