"""The NIXL backend between two OS processes: a real ``pdserve prefill --kv-backend nixl``
process and a receiver here. Verified READs are byte-identical to the sender's blocks (the
digest covers every byte) and decode as one engine; a killed sender fails the pull with
UNAVAILABLE, a stopped one within the timeout; a sender restarted at the same address is
handshaken again, with no crash and no read of the dead agent's memory."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from engine import PrefilledRequest, SamplingParams
from kvtransfer import KVTransferError, ReceiverOptions, TransferErrorCode, make_receiver
from kvtransfer.wire import handle_from_proto
from native_engine import LLM
from native_engine.llm_engine import LLMEngine
from pdserve.common.convert import sampling_to_proto
from pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from tests.contract.test_kvtransfer_contract import _finish
from tests.services.harness import engine_config

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(model: Path, port: int, kv_port: int) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "app", "prefill", "--model", str(model),
        "--port", str(port), "--kv-port", str(kv_port), "--kv-backend", "nixl",
        "--num-blocks", "128",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    for line in process.stdout:  # the supervisor's protocol: "pdserve prefill ready <addr>"
        if line.startswith("pdserve prefill ready"):
            return process
    raise AssertionError(f"prefill exited with {process.wait()} before ready")


def test_pulls_across_processes_survive_a_killed_and_restarted_sender(llama_dir: Path) -> None:
    port, kv_port = _free_port(), _free_port()
    prompts = {f"r{i}": [5 + i] * (20 + 7 * i) for i in range(5)}
    reference = {
        rid: out.token_ids
        for rid, out in zip(
            prompts, LLM(str(llama_dir)).generate(list(prompts.values()), PARAMS), strict=True
        )
    }
    decode = LLMEngine(engine_config(llama_dir))
    process = _start(llama_dir, port, kv_port)

    async def prefill(rid: str) -> tuple[PrefilledRequest, list[int], object]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            response = await prefill_pb2_grpc.PrefillWorkerStub(channel).Prefill(
                prefill_pb2.PrefillRequest(
                    request_id=rid,
                    prompt_token_ids=prompts[rid],
                    sampling=sampling_to_proto(PARAMS),
                )
            )
        prefilled = PrefilledRequest(rid, prompts[rid], response.first_token_id, PARAMS, [])
        block_ids = decode.reserve_prefilled(prefilled)
        assert block_ids is not None
        return prefilled, block_ids, handle_from_proto(response.lease)

    async def run() -> None:
        nonlocal process
        receiver = make_receiver(
            "nixl", decode.kv_cache, ReceiverOptions(timeout_s=10.0, verify=True)
        )
        try:
            # A verified pull: every byte as the sender holds it; then one engine's tokens.
            prefilled, block_ids, handle = await prefill("r0")
            stats = await receiver.pull(handle, block_ids)  # type: ignore[arg-type]
            assert stats.num_bytes == len(block_ids) * decode.kv_layout.block_bytes
            assert _finish(decode, prefilled) == reference["r0"]
            # Killed after issuing a handle: the pull fails cleanly, the caller frees.
            prefilled, block_ids, handle = await prefill("r1")
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)
            with pytest.raises(KVTransferError) as err:
                await receiver.pull(handle, block_ids)  # type: ignore[arg-type]
            assert err.value.code is TransferErrorCode.UNAVAILABLE
            decode.abort("r1")
            # Restarted at the same address: a new agent, handshaken again before any READ.
            process = _start(llama_dir, port, kv_port)
            for rid in ("r2", "r3"):
                prefilled, block_ids, handle = await prefill(rid)
                await receiver.pull(handle, block_ids)  # type: ignore[arg-type]
                assert _finish(decode, prefilled) == reference[rid]
            # Stopped: nothing answers the checkout; the pull ends within its timeout.
            prefilled, block_ids, handle = await prefill("r4")
            os.kill(process.pid, signal.SIGSTOP)
            try:
                start = time.monotonic()
                with pytest.raises(KVTransferError) as err:
                    await receiver.pull(handle, block_ids)  # type: ignore[arg-type]
                assert err.value.code is TransferErrorCode.UNAVAILABLE
                assert time.monotonic() - start < 60  # timeout_s (10 s) bounds it, loosely
            finally:
                os.kill(process.pid, signal.SIGCONT)
            decode.abort("r4")
            decode.block_manager.check_no_leaks()
        finally:
            await receiver.close()

    try:
        asyncio.run(run())
    finally:
        process.kill()
        process.wait(timeout=30)
