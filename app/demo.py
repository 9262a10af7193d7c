"""``pdserve demo``: a local disaggregated cluster (1 prefill + 1 decode worker, embedded
Redis) with the OpenAI API on, three chat questions streamed through it, a clean stop.

TTFT and TPOT are measured here, on the client, from the streamed chunks: what a user of the
API sees.
"""

from __future__ import annotations

import asyncio

from app.openai_client import http_client, stream

QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Why is the sky blue? Answer in one sentence.",
)


def run_demo(model: str, max_tokens: int) -> int:
    from app.embedded_redis import EmbeddedRedis
    from app.local_cluster import ClusterConfig, LocalCluster
    from engine.model_config import ModelConfig

    ModelConfig.from_dir(model)  # a bad directory fails here, named
    print("starting embedded Redis, router (OpenAI API on), 1 prefill + 1 decode worker ...")
    redis = EmbeddedRedis().start()
    # Short chat prompts would be prefilled on the decode worker (conditional
    # disaggregation); the demo shows the disaggregated path.
    config = ClusterConfig(
        model=model,
        log_level="WARNING",
        redis_url=redis.url,
        router_http_port=0,
        router_args=("--local-prefill-tokens", "0", "--served-model-name", "demo"),
    )
    try:
        cluster = LocalCluster(config).start()
    except BaseException:
        redis.stop()
        raise

    async def ask_all() -> None:
        async with http_client(cluster.http_url, timeout_s=300.0) as client:
            for question in QUESTIONS:
                print(f"\n>>> {question}\n", end="", flush=True)
                loop = asyncio.get_running_loop()
                sent_s = loop.time()
                body = {
                    "model": "demo",
                    "messages": [{"role": "user", "content": question}],
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                }
                result = await stream(
                    client,
                    "/v1/chat/completions",
                    body,
                    on_text=lambda t: print(t, end="", flush=True),
                    clock=loop.time,
                )
                times = result.chunk_times_s
                ttft_ms = (times[0] - sent_s) * 1e3 if times else float("nan")
                num_tokens = int(result.usage.get("completion_tokens", 0))
                tpot_ms = (
                    (times[-1] - times[0]) / (num_tokens - 1) * 1e3
                    if num_tokens > 1 and times
                    else 0.0
                )
                print(
                    f"\n    [{num_tokens} tokens, {result.finish_reason}: TTFT {ttft_ms:.1f} ms,"
                    f" TPOT {tpot_ms:.2f} ms, measured by this client]"
                )

    try:
        print(f"cluster ready: OpenAI API at {cluster.http_url}/v1 (model 'demo')")
        asyncio.run(ask_all())
    finally:
        codes = cluster.stop()
        redis.stop()
    print(f"\nshut down cleanly: {codes}")
    return 0 if all(code == 0 for code in codes.values()) else 1
