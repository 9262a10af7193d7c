"""The shared service lifecycle: NOT_SERVING while loading, SERVING when ready, NOT_SERVING and
refusing new work while draining, stop once in-flight work is done."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import SamplingParams
from native_engine.builder import build_native_engine
from pdserve.common.convert import sampling_to_proto
from pdserve.common.server import ServerConfig, ServiceServer
from pdserve.v1 import prefill_pb2
from prefill_service.config import PrefillConfig
from prefill_service.service import PrefillService
from tests.services.harness import engine_config, prefill_stub


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.PrefillWorker")
        )
        return int(reply.status)


def _request() -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        sampling=sampling_to_proto(SamplingParams(max_tokens=4)),
    )


def test_health_follows_load_and_drain(llama_dir: Path) -> None:
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )

    async def run() -> None:
        service = PrefillService(
            PrefillConfig(engine=engine_config(llama_dir)), build_native_engine
        )
        server = ServiceServer(service, ServerConfig(port=0, drain_timeout_s=30))
        await server.start()
        assert await _health(server.address) == not_serving
        stub = prefill_stub(server)
        request = _request()
        try:
            await stub.Prefill(request)
            raise AssertionError("a loading worker accepted work")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            assert "loading" in (exc.details() or "")
        await server.ready()
        assert await _health(server.address) == serving
        prefilled = await stub.Prefill(request)  # leaves a lease: in flight until released

        shutdown = asyncio.create_task(server.shutdown())
        while not service.draining:
            await asyncio.sleep(0)
        assert await _health(server.address) == not_serving
        try:
            await stub.Prefill(prefill_pb2.PrefillRequest(request_id="s", prompt_token_ids=[1]))
            raise AssertionError("a draining worker accepted work")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in (exc.details() or "")
        assert not shutdown.done()  # waits for the lease
        # Its token is needed: a caller that knows only the request id ends nothing.
        wrong = prefill_pb2.ReleaseRequest(request_id="r", lease_token="guess")
        assert not (await stub.Release(wrong)).released
        token = prefilled.lease.lease_token
        released = await stub.Release(prefill_pb2.ReleaseRequest(request_id="r", lease_token=token))
        assert released.released
        await asyncio.wait_for(shutdown, 10)

    asyncio.run(run())


def test_a_dead_engine_turns_the_worker_not_serving_and_stops_it(llama_dir: Path) -> None:
    """A failed engine step: the request gets UNAVAILABLE, health NOT_SERVING, and the service
    stops itself with the failure recorded (the CLI then exits 1 so a supervisor restarts it)."""
    from pdserve.common.server import serve

    async def run() -> None:
        service = PrefillService(
            PrefillConfig(engine=engine_config(llama_dir)), build_native_engine
        )
        ready: asyncio.Queue[str] = asyncio.Queue()

        def on_event(event: str, address: str) -> None:
            if event == "ready":
                ready.put_nowait(address)

        serving = asyncio.create_task(
            serve(service, ServerConfig(port=0), on_event=on_event, signals=False)
        )
        address = await asyncio.wait_for(ready.get(), 60)
        assert await _health(address) == health_pb2.HealthCheckResponse.SERVING

        def broken_step() -> None:  # a fault in the model code, e.g. a CUDA error
            raise RuntimeError("device lost")

        service.engine._engine.step = broken_step  # type: ignore[method-assign]
        async with grpc.aio.insecure_channel(address) as channel:
            from pdserve.v1 import prefill_pb2_grpc

            stub = prefill_pb2_grpc.PrefillWorkerStub(channel)
            try:
                await stub.Prefill(_request())
                raise AssertionError("a dead engine served a request")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
                assert "device lost" in (exc.details() or "")
        await asyncio.wait_for(serving, 30)  # stopped by itself, gracefully
        assert isinstance(service.failure, RuntimeError)

    asyncio.run(run())
