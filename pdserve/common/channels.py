"""gRPC channel settings, and one cached ``grpc.aio`` channel per peer address."""

from __future__ import annotations

import grpc

# KV chunks and long prompts exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 256 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def insecure_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)


class ChannelPool:
    """Channels to peers, created on first use and closed together at shutdown."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = insecure_channel(address)
            self._channels[address] = channel
        return channel

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()
