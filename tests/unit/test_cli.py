"""The `pdserve` console script: make-model then demo (as `make demo` runs it, with a tiny
random model instead of the real one)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from app.cli import main
from kvstore_service.config import KVStoreConfig
from pdserve.common.role import Role


def test_make_model_and_demo_through_the_console_script(tmp_path: Path) -> None:
    model_dir = tmp_path / "demo-model"
    exe = Path(sys.executable).parent / "pdserve"
    made = subprocess.run(
        [str(exe), "make-model", str(model_dir), "--arch", "qwen2", "--seed", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "wrote qwen2/tiny" in made.stdout
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == [
        "Qwen2ForCausalLM"
    ]
    demo = subprocess.run(
        [str(exe), "demo", "--model", str(model_dir), "--max-tokens", "5"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    # Three chat answers through the OpenAI API (a random model may stop early at its EOS).
    answers = re.findall(r"\[(\d+) tokens, (stop|length): TTFT [\d.]+ ms", demo.stdout)
    assert len(answers) == 3 and all(1 <= int(n) <= 5 for n, _ in answers), demo.stdout


def test_errors_are_reported_without_traceback(tmp_path: Path, capsys) -> None:
    assert main(["demo", "--model", str(tmp_path / "missing")]) == 2
    assert "config.json" in capsys.readouterr().err


def test_every_serving_flag_reads_its_environment_variable(monkeypatch) -> None:
    from app.cli import build_parser

    monkeypatch.setenv("PDSERVE_LEASE_S", "7.5")
    monkeypatch.setenv("PDSERVE_MODEL", "/models/x")
    monkeypatch.setenv("PDSERVE_NO_PREFIX_CACHING", "true")
    args = build_parser().parse_args(["prefill"])
    assert (args.lease_s, args.model, args.no_prefix_caching) == (7.5, "/models/x", True)
    # The command line still wins over the environment.
    assert build_parser().parse_args(["prefill", "--lease-s", "2"]).lease_s == 2.0
    monkeypatch.setenv("PDSERVE_DECODE", "a:1,b:2")
    monkeypatch.setenv("PDSERVE_PREFILL", "c:3")
    router = build_parser().parse_args(["router"])
    assert (router.prefill, router.decode) == (("c:3",), ("a:1", "b:2"))


def test_up_and_ray_up_pass_speculation_to_every_decode_worker(tmp_path: Path) -> None:
    from app import settings
    from app.cli import build_parser
    from app.ray_deploy.commands import _deployment_spec
    from app.up_command import cluster_config

    flags = ["--speculative-method", "draft", "--spec-draft-model", "/d"]
    flags += ["--num-speculative-tokens", "5"]
    args = build_parser().parse_args(["up", "--model", "/m", *flags])
    args.redis_url = "redis://127.0.0.1:1"  # what `pdserve up` sets once Redis is up
    cluster = cluster_config(args)
    decode = settings.parse_service_flags(Role.DECODE, ["--model", "/m", *cluster.decode_args])
    spec = decode.engine.speculative  # type: ignore[union-attr]
    assert spec is not None and (spec.draft_model, spec.num_speculative_tokens) == ("/d", 5)
    assert not [a for a in cluster.prefill_args if "spec" in a]
    ray_args = build_parser().parse_args(["ray", "up", "--model", "/m", *flags])
    assert _deployment_spec(ray_args).decode.engine.speculative == spec
    # A bad combination is refused by name before anything starts.
    bad = build_parser().parse_args(["up", "--model", "/m", "--speculative-method", "draft"])
    bad.redis_url = ""
    with pytest.raises(ValueError, match="spec_draft_model"):
        cluster_config(bad)


def _up_configs(*flags: str) -> dict[str, Any]:
    """The configs ``pdserve up --model /m FLAGS`` gives its prefill, decode and router."""
    from app import settings
    from app.cli import build_parser
    from app.up_command import cluster_config

    args = build_parser().parse_args(["up", "--model", "/m", *flags])
    args.redis_url = "redis://127.0.0.1:1"  # what `pdserve up` sets once Redis is up
    cluster = cluster_config(args)
    argv = {"prefill": cluster.prefill_args, "decode": cluster.decode_args}
    # `pdserve up` gives the router its Redis when it starts it, not in router_args.
    argv["router"] = ("--redis", args.redis_url, *cluster.router_args)
    return {
        role: settings.parse_service_flags(Role(role), ["--model", "/m", *role_argv])
        for role, role_argv in argv.items()
    }


def test_up_passes_the_host_tier_to_every_worker() -> None:
    configs = _up_configs("--host-cache-gib", "2")
    for role in ("prefill", "decode"):
        assert configs[role].engine.cache.host_cache_gib == 2.0


def test_up_and_ray_up_pass_the_kv_cache_dtype_to_every_component() -> None:
    """The router computes the workers' fingerprint itself: it must get the same dtype."""
    from app.cli import build_parser
    from app.ray_deploy.commands import _deployment_spec
    from engine.kv_layout import KVCacheDtype

    configs = _up_configs("--kv-cache-dtype", "int8")
    for role in ("prefill", "decode"):
        assert configs[role].engine.cache.kv_cache_dtype is KVCacheDtype.INT8
    assert configs["router"].layout.kv_cache_dtype is KVCacheDtype.INT8
    ray = _deployment_spec(
        build_parser().parse_args(["ray", "up", "--model", "/m", "--kv-cache-dtype", "fp8_e4m3"])
    )
    assert ray.router.layout.kv_cache_dtype is KVCacheDtype.FP8_E4M3
    for worker in (ray.prefill, ray.decode):
        assert worker.engine.cache.kv_cache_dtype is KVCacheDtype.FP8_E4M3
    with pytest.raises(SystemExit):  # argparse names the choices
        build_parser().parse_args(["up", "--model", "/m", "--kv-cache-dtype", "int4"])


def test_up_and_ray_up_trace_every_component_to_one_collector() -> None:
    from app.cli import build_parser
    from app.ray_deploy.commands import _deployment_spec
    from pdserve.common.tracing import TracingConfig

    traced = ("--otlp-endpoint", "http://collector:4317", "--trace-sample-ratio", "0.25")
    expected = TracingConfig(endpoint="http://collector:4317", sample_ratio=0.25)
    configs = _up_configs(*traced)
    assert {role: c.server.tracing for role, c in configs.items()} == dict.fromkeys(
        ("prefill", "decode", "router"), expected
    )
    ray = _deployment_spec(build_parser().parse_args(["ray", "up", "--model", "/m", *traced]))
    assert {c.server.tracing for c in (ray.prefill, ray.decode, ray.router)} == {expected}
    untraced = _up_configs()
    assert not any(c.server.tracing.enabled for c in untraced.values())


def test_up_gives_each_native_worker_its_share_of_the_cpus() -> None:
    """Workers of one `pdserve up` share the machine: OpenMP threads past its cores spin
    against each other. vLLM workers bind their own."""
    import os

    cores = len(os.sched_getaffinity(0))
    configs = _up_configs("--prefill", "1", "--decode", "1")
    for role in ("prefill", "decode"):
        assert configs[role].engine.num_threads == max(1, cores // 2)
    assert _up_configs("--decode", "3")["decode"].engine.num_threads == max(1, cores // 4)
    assert _up_configs("--engine", "vllm")["decode"].engine.num_threads is None


def test_up_with_kv_stores_passes_them_their_flags_and_warns_what_makes_them_useless() -> None:
    from app import settings
    from app.cli import build_parser
    from app.up_command import cluster_config, kvstore_warnings

    def up(*flags: str) -> Any:
        args = build_parser().parse_args(["up", "--model", "/m", "--kvstore", "2", *flags])
        args.redis_url = "redis://127.0.0.1:1"
        return cluster_config(args)

    cluster = up("--kvstore-args", "--capacity-gib 3", "--kv-cache-dtype", "int8")
    store = settings.parse_service_flags(Role.KVSTORE, ["--model", "/m", *cluster.kvstore_args])
    assert isinstance(store, KVStoreConfig) and cluster.num_kvstore == 2
    assert (store.capacity_gib, store.layout.kv_cache_dtype.value) == (3.0, "int8")
    warnings = kvstore_warnings(cluster)
    assert len(warnings) == 2 and "--host-cache-gib" in warnings[0] and "cost" in warnings[1]
    quiet = up("--host-cache-gib", "1", "--router-args", "--prefill-policy cost")
    assert kvstore_warnings(quiet) == []
