"""What ``pdserve ray up`` deploys (validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cluster.registry import Role

DEFAULT_NAMESPACE = "pdserve"
CONTROLLER_NAME = "pdserve-controller"


@dataclass(frozen=True)
class DeploymentSpec:
    model: str
    num_prefill: int = 1
    num_decode: int = 1
    num_gpus_per_worker: float = 0.0  # Ray places each worker on a node with this many GPUs
    num_cpus_per_worker: float = 1.0
    transfer: str = "ray"  # KV transfer backend: ray (object store) or grpc
    redis_url: str = ""  # "": an embedded redis-server in the controller (single-node only)
    router_port: int = 50051  # 0: ephemeral
    max_restarts: int = 3  # per actor; a crashed worker comes back at most this often
    dtype: str = "float32"
    block_size: int = 16
    prefill_args: tuple[str, ...] = ()  # extra `pdserve prefill` flags
    decode_args: tuple[str, ...] = ()  # extra `pdserve decode` flags
    router_args: tuple[str, ...] = ()  # extra `pdserve router` flags
    ready_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("a deployment needs num_prefill >= 1 and num_decode >= 1")
        if self.num_gpus_per_worker < 0 or self.num_cpus_per_worker < 0:
            raise ValueError("num_gpus_per_worker and num_cpus_per_worker must be >= 0")
        if self.transfer not in ("ray", "grpc"):
            raise ValueError(f"transfer must be ray or grpc, got {self.transfer!r}")
        if not 0 <= self.router_port <= 65535:
            raise ValueError(f"router_port must be in [0, 65535], got {self.router_port}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.ready_timeout_s <= 0 or self.drain_timeout_s <= 0:
            raise ValueError("ready_timeout_s and drain_timeout_s must be > 0")

    def worker_argv(self, role: Role, redis_url: str) -> list[str]:
        """The flags of ``pdserve prefill|decode``, as in process mode."""
        argv = [role.value, *self._common(redis_url), "--port", "0", "--metrics-port", "0"]
        argv += ["--kv-backend", self.transfer]
        if self.num_gpus_per_worker > 0:
            argv += ["--device", "cuda"]  # Ray sets CUDA_VISIBLE_DEVICES to the actor's GPUs
        if role is Role.PREFILL:
            return [*argv, "--kv-port", "0", *self.prefill_args]
        return [*argv, *self.decode_args]

    def router_argv(self, redis_url: str) -> list[str]:
        argv = ["router", *self._common(redis_url), "--port", str(self.router_port)]
        return [*argv, "--metrics-port", "0", *self.router_args]

    def _common(self, redis_url: str) -> list[str]:
        return [
            "--model",
            self.model,
            "--redis",
            redis_url,
            "--dtype",
            self.dtype,
            "--block-size",
            str(self.block_size),
            "--drain-timeout-s",
            str(self.drain_timeout_s),
        ]
