"""gRPC channel and server settings, and one cached ``grpc.aio`` channel per peer address."""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import grpc

from pdserve.common import peer_token
from pdserve.common.tls import TlsConfig

logger = logging.getLogger(__name__)

# KV chunks and long prompts exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 256 << 20
GRPC_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# HTTP/2 keepalive pings while calls are open: a peer that stops answering (frozen, or a
# partition without a TCP reset) fails its calls with UNAVAILABLE instead of hanging them. A
# backstop: the router's stall timeout and stats checks usually notice first.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    # A ping's ack is awaited this long (gRPC's default is a minute, whatever the keepalive
    # timeout says).
    ("grpc.http2.ping_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
]
# Reconnects to a lost peer back off exponentially from 1 s, capped at 5 s rather than gRPC's
# 120 s: a worker restarted in place (a container restart keeps its pod's IP) is reached
# within seconds of coming back, by the router's stats calls too. And each channel owns its
# connections: gRPC otherwise shares subchannels process-wide between channels with the same
# target and arguments, so a new channel after ``ChannelPool.reset`` would inherit the failed
# one's backoff.
CLIENT_OPTIONS = [
    *KEEPALIVE_OPTIONS,
    ("grpc.max_reconnect_backoff_ms", 5_000),
    ("grpc.use_local_subchannel_pool", 1),
]
# Servers accept those pings (gRPC's default answers frequent pings with GOAWAY).
SERVER_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]
# Between services. Token streams get a small fixed HTTP/2 window (16 KiB, no bandwidth probing,
# which grows it to megabytes): a reader that stops reading then stops its writer within a
# few hundred tokens, and the worker's bounded output buffer pauses the request.
CONTROL_OPTIONS = [
    *GRPC_OPTIONS,
    *CLIENT_OPTIONS,
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", 16 << 10),
]
# KV transfer streams want the large windows bandwidth probing gives them.
TRANSFER_OPTIONS = [*GRPC_OPTIONS, *CLIENT_OPTIONS]


Options = list[tuple[str, int | str]]
_OPEN_CALLS_POLL_S = 1.0


def insecure_channel(address: str, options: Options = GRPC_OPTIONS) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=options)


def peer_channel(address: str, tls: TlsConfig | None, options: Options) -> grpc.aio.Channel:
    """A channel to another pdserve service: mutual TLS when ``tls`` is set."""
    interceptors = peer_token.client_interceptors()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(
        address,
        tls.channel_credentials(),
        options=[*options, *tls.channel_options()],
        interceptors=interceptors,
    )


class ChannelPool:
    """Channels to peers, created on first use and closed together at shutdown, or retired
    once their peer has left (``retain``) or failed (``reset``). Callers ``get`` a channel for
    each call and keep none between calls. A retired channel keeps working for its grace
    (calls in flight finish; a caller between ``get`` and its call still gets through), then
    closes: ``retired_grace_s`` after a certificate change, ``left_grace_s`` after a peer left
    or failed (only stragglers are on it; and a dead peer's channel keeps redialling until
    it closes).

    With TLS, a change of the certificate files (a cert-manager renewal), seen at the first
    ``get`` after it (looked for at most every ``recheck_s``), retires every channel: new calls
    get new channels presenting the new certificate. Without that, a long-running client would
    present its first certificate until it expired."""

    def __init__(
        self,
        options: Options = CONTROL_OPTIONS,
        tls: TlsConfig | None = None,
        *,
        recheck_s: float = 1.0,  # how often the certificate files are looked at
        retired_grace_s: float = 600.0,
        left_grace_s: float = 30.0,
    ) -> None:
        self.options = options
        self.tls = tls
        self.recheck_s = recheck_s
        self.retired_grace_s = retired_grace_s
        self.left_grace_s = left_grace_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._mtimes = tls.mtimes() if tls is not None else ()
        self._checked_s = time.monotonic()
        self._retired: dict[grpc.aio.Channel, asyncio.Task[None]] = {}
        # Long calls (token relays) on each channel: a retired one closes only once they end.
        self._open_calls: dict[grpc.aio.Channel, int] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        self._check_certificates()
        channel = self._channels.get(address)
        if channel is None:
            channel = peer_channel(address, self.tls, self.options)
            self._channels[address] = channel
        return channel

    def _check_certificates(self) -> None:
        now = time.monotonic()
        if self.tls is None or now - self._checked_s < self.recheck_s:
            return
        self._checked_s = now
        try:
            mtimes = self.tls.mtimes()
        except OSError:  # files mid-swap: keep the current channels, look again later
            return
        if mtimes == self._mtimes:
            return
        self._mtimes = mtimes
        logger.info("tls files changed: %d channels retired", len(self._channels))
        retired, self._channels = self._channels, {}
        for channel in retired.values():
            self._retire(channel, self.retired_grace_s)

    def reset(self, address: str, channel: grpc.aio.Channel) -> None:
        """Retires ``channel``, on which a call to ``address`` just failed UNAVAILABLE, unless
        the pool has replaced it already: the next call gets a fresh channel. gRPC backs a
        failing channel's reconnects off, so a peer restarted at the same address would
        otherwise wait out that backoff."""
        if self._channels.get(address) is channel:
            del self._channels[address]
            self._retire(channel, self.left_grace_s)

    def track(self, channel: grpc.aio.Channel, call: grpc.aio.Call) -> None:
        """``call``, on ``channel``, may outlive a retirement's grace (a stream that relays a
        long generation): the channel, once retired, closes after the grace and after the
        call ends, so a certificate renewal does not cut it (and re-prefill it)."""
        self._open_calls[channel] = self._open_calls.get(channel, 0) + 1
        call.add_done_callback(lambda _: self._untrack(channel))

    def _untrack(self, channel: grpc.aio.Channel) -> None:
        left = self._open_calls.get(channel, 1) - 1
        if left:
            self._open_calls[channel] = left
        else:
            self._open_calls.pop(channel, None)

    def _retire(self, channel: grpc.aio.Channel, grace_s: float) -> None:
        task = asyncio.get_running_loop().create_task(self._close_later(channel, grace_s))
        self._retired[channel] = task
        task.add_done_callback(functools.partial(self._closed, channel))

    def _closed(self, channel: grpc.aio.Channel, _: asyncio.Task[None]) -> None:
        self._retired.pop(channel, None)

    async def retain(self, addresses: set[str]) -> None:
        """Retires the channels to every other address (peers that left)."""
        gone = [a for a in self._channels if a not in addresses]
        for address in gone:
            self._retire(self._channels.pop(address), self.left_grace_s)

    async def _close_later(self, channel: grpc.aio.Channel, grace_s: float) -> None:
        """Not ``channel.close(grace)``: that refuses new calls at once, and once cancelled
        (at ``ChannelPool.close``) leaves the channel closing for ever. Tracked calls still
        open past the grace keep it (a dead peer's fail by keepalive, so this ends)."""
        await asyncio.sleep(grace_s)
        while channel in self._open_calls:
            await asyncio.sleep(_OPEN_CALLS_POLL_S)
        await channel.close()

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        retired, self._retired = self._retired, {}
        for task in retired.values():
            task.cancel()
        await asyncio.gather(*retired.values(), return_exceptions=True)
        for channel in [*channels.values(), *retired]:
            await channel.close()
