"""A decode worker pulls KV only from prefill workers it knows, for the prompt the KV was
computed for, with the lease's token: a request naming another address, another prompt, or no
token is refused before anything is reserved, and leases cannot be ended by a guess."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from engine import SamplingParams
from pdserve.common.convert import sampling_to_proto
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    prefill_pb2,
)
from tests.services.harness import (
    all_blocks_free,
    decode_stub,
    prefill_stub,
    start_decode,
    start_prefill,
    wait_for,
)

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = list(range(9, 70))


def test_unknown_sources_wrong_prompts_and_missing_tokens_are_refused(llama_dir: Path) -> None:
    async def run() -> None:
        _, prefill_server = await start_prefill(llama_dir)
        _, stranger_server = await start_prefill(llama_dir)  # not a peer of decode's
        _, decode_server = await start_decode(llama_dir, peers=[prefill_server])
        sampling = sampling_to_proto(PARAMS)
        try:

            async def prefilled(server: object) -> prefill_pb2.PrefillResponse:
                return await prefill_stub(server).Prefill(  # type: ignore[arg-type]
                    prefill_pb2.PrefillRequest(
                        request_id="r", prompt_token_ids=PROMPT, sampling=sampling
                    )
                )

            ok, foreign = await prefilled(prefill_server), await prefilled(stranger_server)

            def decode_request(
                response: prefill_pb2.PrefillResponse, address: str, prompt: list[int]
            ) -> decode_pb2.DecodeRequest:
                return decode_pb2.DecodeRequest(
                    request_id="d", prompt_token_ids=prompt, sampling=sampling,
                    first_token_id=response.first_token_id, handle=response.lease,
                    prefill_address=address,
                )  # fmt: skip

            cases = {
                "an unknown prefill worker": decode_request(
                    foreign, stranger_server.address, PROMPT
                ),
                "a known worker named with a stranger's KV sender": decode_request(
                    foreign, prefill_server.address, PROMPT
                ),
                "other prompt ids than the KV's": decode_request(
                    ok, prefill_server.address, [*PROMPT[:-1], 3]
                ),
            }
            stub = decode_stub(decode_server)
            for what, request in cases.items():
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Decode(request):
                        pass
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, what
                # Refused before reserving anything.
                stats = await stub.GetStats(common_pb2.GetStatsRequest())
                assert stats.num_free_blocks == stats.num_blocks, what

            # The KV port wants the lease's token; Release and RenewLease too.
            kv = kv_transfer_pb2_grpc.KVTransferStub(grpc.aio.insecure_channel(ok.lease.address))
            layout = ok.lease.layout
            with pytest.raises(grpc.aio.AioRpcError) as err:
                pull = kv.Pull(kv_transfer_pb2.PullRequest(request_id="r", receiver_layout=layout))
                await pull.read()
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            guess = prefill_pb2.ReleaseRequest(request_id="r", lease_token="0" * 32)
            assert not (await prefill_stub(prefill_server).Release(guess)).released
            renew = prefill_pb2.RenewLeaseRequest(request_id="r", lease_token="0" * 32)
            assert not (await prefill_stub(prefill_server).RenewLease(renew)).renewed

            # The right request still works, and everything is freed.
            tokens = [
                t
                async for r in stub.Decode(decode_request(ok, prefill_server.address, PROMPT))
                for t in r.tokens.token_ids
            ]
            assert len(tokens) == PARAMS.max_tokens - 1
            for worker in (prefill_stub(prefill_server), decode_stub(decode_server)):
                await wait_for(lambda w=worker: all_blocks_free(w), 30.0, "blocks freed")
            token = foreign.lease.lease_token
            release = prefill_pb2.ReleaseRequest(request_id="r", lease_token=token)
            assert (await prefill_stub(stranger_server).Release(release)).released
        finally:
            await decode_server.shutdown()
            await stranger_server.shutdown()
            await prefill_server.shutdown()

    asyncio.run(run())
