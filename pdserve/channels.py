"""One cached ``grpc.aio`` channel per peer address, closed together at shutdown."""

from __future__ import annotations

import grpc

from pdserve.server import GRPC_OPTIONS


class ChannelPool:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()
