"""vLLM's own disaggregated serving, as vLLM's example proxy drives it: the baseline of
``serving.py``'s ``vllm-pd`` system (two ``vllm serve`` with vLLM's ``NixlConnector``).

The proxy follows vLLM's toy proxy (``tests/v1/kv_connector/nixl_integration``): a completion
goes to the prefill server with ``max_tokens`` 1, not streamed, and ``kv_transfer_params``
asking for a remote decode; the prefill's answer carries the ``kv_transfer_params`` the decode
server needs (its engine id, block ids, host and port), which go with the original request to
the decode server, whose answer (streamed or not) is relayed as is. Run in ``.venv-vllm``:
``python benchmarks/vllm_pd_proxy.py --port P --prefill URL --decode URL``.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import aiohttp
from aiohttp import web

_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_TIMEOUT = aiohttp.ClientTimeout(total=3600)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    first = copy.deepcopy(body)
    first.update(kv_transfer_params=dict(_REMOTE_DECODE), stream=False, max_tokens=1)
    first.pop("stream_options", None)
    first.pop("max_completion_tokens", None)
    return first


def make_app(prefill: str, decode: str) -> web.Application:
    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        session: aiohttp.ClientSession = request.app["session"]
        url = f"{prefill}{request.path}"
        async with session.post(url, json=prefill_body(body)) as first:
            if first.status != 200:
                return web.Response(status=first.status, body=await first.read())
            params = (await first.json()).get("kv_transfer_params")
        second = dict(body, kv_transfer_params=params)
        async with session.post(f"{decode}{request.path}", json=second) as answer:
            out = web.StreamResponse(status=answer.status)
            out.content_type = answer.content_type
            await out.prepare(request)
            async for chunk in answer.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(request: web.Request) -> web.Response:
        session: aiohttp.ClientSession = request.app["session"]
        async with session.get(f"{decode}/v1/models") as answer:
            return web.Response(status=answer.status, body=await answer.read())

    async def start(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(timeout=_TIMEOUT)

    async def stop(app: web.Application) -> None:
        await app["session"].close()

    app = web.Application()
    app.router.add_post("/v1/completions", relay)
    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", required=True, help="the prefill vllm serve's URL")
    p.add_argument("--decode", required=True, help="the decode vllm serve's URL")
    args = p.parse_args()
    web.run_app(make_app(args.prefill, args.decode), host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
