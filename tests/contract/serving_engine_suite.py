"""The ``ServingEngine`` contract (engine/serving_engine.py), as one suite every engine runs:
the native engine here (``test_serving_engine_native.py``), vLLM in its own environment
(``tests/vllm/test_serving_engine_vllm.py``).

Each case takes a started engine and prompts that fit it, and leaves every block free (the
engine's own free count back where it started). The disaggregation hooks are exercised on one
engine: a prefill-only run's pinned pages are copied through ``kv_pages`` into the blocks
``admit_prefilled`` hands out, and the stream continues exactly as the plain run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
from collections.abc import Awaitable, Callable

import pytest

from engine.block_hash import hash_blocks, root_hash
from engine.config import DEFAULT_MAX_BUFFERED_TOKENS
from engine.outputs import PrefilledRequest, RequestOutput
from engine.sampling_params import SamplingParams
from engine.serving_engine import NoRoomError, PeerPullUnsupported, ServingEngine
from engine.structured_output import StructuredKind, StructuredOutput
from tests.services.harness import wait_for

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
_PENALTIES = {
    "presence_penalty": 0.5,
    "frequency_penalty": 0.4,
    "repetition_penalty": 1.3,
    "logit_bias": {5: 2.0, 9: -3.0},
}
# With logit processing, which counts the earlier output (the first token on a decode worker,
# a migrated stream's output) as output, never as prompt.
PENALIZED = (
    dataclasses.replace(GREEDY, **_PENALTIES),  # type: ignore[arg-type]
    dataclasses.replace(SEEDED, **_PENALTIES),  # type: ignore[arg-type]
)
# Guided: the continuing engine replays the grammar over the earlier output.
WORDS = StructuredOutput(StructuredKind.REGEX, "[a-z ,.]+", "guided_regex")
GUIDED = (
    dataclasses.replace(GREEDY, structured=WORDS),
    dataclasses.replace(SEEDED, structured=WORDS, presence_penalty=0.5),
)
Case = Callable[[ServingEngine, list[int]], Awaitable[None]]


async def collect(stream: object) -> RequestOutput:
    out = RequestOutput("r", [])
    async for update in stream:  # type: ignore[attr-defined]
        out.apply(update)
    return out


async def settled(engine: ServingEngine, free: int) -> None:
    """Every block back (a freed request's blocks may wait for the engine's next step)."""

    async def back() -> bool:
        s = engine.stats
        return (s.num_free_blocks, s.num_pinned, s.num_running, s.num_waiting) == (free, 0, 0, 0)

    await wait_for(back, 30.0, "every block free again")


async def prefill(
    engine: ServingEngine, rid: str, prompt: list[int], params: SamplingParams
) -> PrefilledRequest:
    last = None
    async for update in engine.generate(rid, prompt, params, prefill_only=True):
        last = update
    assert last is not None and last.prefilled
    return engine.export_prefilled(rid)


def copy_pages(engine: ServingEngine, source: list[int]) -> Callable[[list[int]], Awaitable[int]]:
    """A fill that copies the pinned pages ``source`` into the admitted blocks, slab by slab
    (what a KV receiver does)."""

    async def fill(block_ids: list[int]) -> int:
        pages = engine.kv_pages
        assert pages is not None
        for slab in range(2 * pages.layout.num_layers):
            pages.write_slabs(slab, block_ids, pages.read_slabs(slab, 1, source))
        return len(block_ids)

    return fill


async def prefilled_then_decoded_is_the_plain_run(engine: ServingEngine, prompt: list[int]) -> None:
    free = engine.stats.num_free_blocks
    for params in (GREEDY, SEEDED, *PENALIZED, *GUIDED):
        plain = await collect(engine.generate("plain", prompt, params))
        assert plain.finish_reason == "length" and len(plain.token_ids) == params.max_tokens
        exported = await prefill(engine, "p", prompt, params)
        assert exported.first_token_id == plain.token_ids[0]
        assert engine.stats.num_pinned == 1
        assert len(exported.block_ids) == engine.blocks_for(len(prompt))
        request = dataclasses.replace(exported, request_id="d", block_ids=[])
        filled = await engine.admit_prefilled(request, copy_pages(engine, exported.block_ids))
        assert filled == len(exported.block_ids)
        decoded = await collect(engine.stream_prefilled(request))
        assert decoded.token_ids == plain.token_ids
        assert decoded.text == plain.text and decoded.finish_reason == plain.finish_reason
        await engine.free_pinned("p")
        with pytest.raises(KeyError):
            await engine.free_pinned("p")  # exactly once
    await settled(engine, free)


async def a_continuation_gives_the_rest_of_the_run(
    engine: ServingEngine, prompt: list[int]
) -> None:
    """Migration: prompt + the first k outputs, with num_generated_tokens=k, continues exactly
    (the seeded sampler's output index included)."""
    for params in (GREEDY, SEEDED, *PENALIZED, *GUIDED):
        plain = await collect(engine.generate("plain", prompt, params))
        k = 5
        rest = await collect(
            engine.generate("rest", prompt + plain.token_ids[:k], params, num_generated_tokens=k)
        )
        assert rest.token_ids == plain.token_ids[k:]


async def a_failed_or_cancelled_fill_frees_its_blocks(
    engine: ServingEngine, prompt: list[int]
) -> None:
    free = engine.stats.num_free_blocks
    exported = await prefill(engine, "p", prompt, GREEDY)

    async def broken(block_ids: list[int]) -> None:
        raise RuntimeError("pull failed")

    request = dataclasses.replace(exported, request_id="d1", block_ids=[])
    with pytest.raises(RuntimeError, match="pull failed"):
        await engine.admit_prefilled(request, broken)
    started, never = asyncio.Event(), asyncio.Event()

    async def stuck(block_ids: list[int]) -> None:
        started.set()
        await never.wait()

    admission = asyncio.ensure_future(
        engine.admit_prefilled(dataclasses.replace(request, request_id="d2"), stuck)
    )
    await asyncio.wait_for(started.wait(), 30)
    admission.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await admission
    await engine.abort("d1")  # gone already: a no-op
    await engine.free_pinned("p")
    await settled(engine, free)


async def a_full_cache_refuses_admission_by_name(engine: ServingEngine, prompt: list[int]) -> None:
    free = engine.stats.num_free_blocks
    pinned = []
    while engine.stats.num_free_blocks >= engine.blocks_for(len(prompt)):
        pinned.append(await prefill(engine, f"p{len(pinned)}", [*prompt, len(pinned)], GREEDY))
    request = dataclasses.replace(pinned[0], request_id="d", block_ids=[])
    with pytest.raises(NoRoomError, match="free KV blocks"):
        await engine.admit_prefilled(request, copy_pages(engine, pinned[0].block_ids))
    for p in pinned:
        await engine.free_pinned(p.request_id)
    await settled(engine, free)


async def leaving_a_stream_aborts_and_frees(engine: ServingEngine, prompt: list[int]) -> None:
    free = engine.stats.num_free_blocks
    stream = engine.generate("a", prompt, dataclasses.replace(GREEDY, max_tokens=200))
    assert (await anext(stream)).request_id == "a"
    await stream.aclose()
    await engine.abort("a")  # gone already: a no-op
    await settled(engine, free)


async def stops_end_where_the_engine_says(engine: ServingEngine, prompt: list[int]) -> None:
    plain = await collect(engine.generate("plain", prompt, GREEDY))
    stop_id = plain.token_ids[3]
    stopped = await collect(
        engine.generate("s", prompt, dataclasses.replace(GREEDY, stop_token_ids=[stop_id]))
    )
    first = plain.token_ids.index(stop_id)
    assert stopped.token_ids == plain.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    with pytest.raises(ValueError, match="stop_token_ids"):
        await collect(
            engine.generate("bad", prompt, dataclasses.replace(GREEDY, stop_token_ids=[10**9]))
        )


async def logit_processing_decides_where_it_should(
    engine: ServingEngine, prompt: list[int]
) -> None:
    """A bias large enough picks every greedy token; min_tokens holds back a stop id biased
    as much until that many tokens are out."""
    biased = await collect(
        engine.generate("b", prompt, dataclasses.replace(GREEDY, logit_bias={7: 100.0}))
    )
    assert biased.token_ids == [7] * GREEDY.max_tokens
    params = dataclasses.replace(
        GREEDY, logit_bias={9: 100.0}, stop_token_ids=[9], min_tokens=4, max_tokens=8
    )
    held = await collect(engine.generate("m", prompt, params))
    assert held.finish_reason == "stop"
    assert len(held.token_ids) == 5 and 9 not in held.token_ids[:4], held.token_ids


async def guided_outputs_hold_and_end_when_complete(
    engine: ServingEngine, prompt: list[int]
) -> None:
    """A regex holds over a whole run; a choice ends the request (stop) once it is made."""
    for params in GUIDED:
        out = await collect(engine.generate("g", prompt, params))
        assert re.fullmatch(WORDS.spec, out.text) and len(out.token_ids) == params.max_tokens
    choices = ["red", "green", "blue and grey"]
    params = dataclasses.replace(GREEDY, structured=StructuredOutput.choice(choices))
    out = await collect(engine.generate("c", prompt, params))
    assert out.text in choices and out.finish_reason == "stop"


async def prompt_logprobs_come_once_with_the_first_token(
    engine: ServingEngine, prompt: list[int]
) -> None:
    """Every prompt token after the first, with its top-n, on the first update with a token;
    they are log-probabilities of a distribution whose top-n they list; a continuation has
    none."""
    params = dataclasses.replace(GREEDY, prompt_logprobs=2, logprobs=2)
    updates = []
    async with contextlib.aclosing(engine.generate("pl", prompt, params)) as stream:
        async for update in stream:
            updates.append(update)
    first = next(u for u in updates if u.new_token_ids)
    entries = first.prompt_logprobs
    assert [e.token_id for e in entries] == prompt[1:]
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0] >= e.top_logprobs[1] for e in entries)
    assert all(e.logprob <= e.top_logprobs[0] + 1e-6 and e.logprob <= 0 for e in entries)
    assert all(not u.prompt_logprobs for u in updates if u is not first)
    plain = await collect(engine.generate("plain", prompt, GREEDY))
    assert first.new_token_ids[0] == plain.token_ids[0]
    rest = await collect(
        engine.generate("rest", prompt + plain.token_ids[:3], params, num_generated_tokens=3)
    )
    assert rest.prompt_logprobs == []


async def kv_events_name_the_prompt_blocks(engine: ServingEngine, prompt: list[int]) -> None:
    """The prefix index hears of every full prompt block, by pdserve's one hasher."""
    prompt = [t + 7 for t in prompt]  # blocks no earlier case cached
    engine.collect_kv_events = True
    engine.take_kv_events()
    await collect(engine.generate("e", prompt, GREEDY))
    stored = {h for events in engine.take_kv_events() for h in events.stored}
    expected = hash_blocks(root_hash(engine.fingerprint), prompt, engine.block_size)
    assert expected and set(expected) <= stored
    snapshot = await engine.snapshot_cached_hashes()
    assert set(expected) <= {h for hashes in snapshot.values() for h in hashes}
    assert engine.take_kv_events() == []  # the snapshot holds them


async def an_unread_request_gives_up_its_seat_then_gets_every_token(
    engine: ServingEngine, prompt: list[int]
) -> None:
    """A reader that stops reading: once the bound of tokens waits, the request holds no seat
    (it is paused), and when the reader takes them, the rest comes exactly as in one run."""
    bound = DEFAULT_MAX_BUFFERED_TOKENS
    params = SamplingParams(max_tokens=bound + 48, temperature=0.0, ignore_eos=True)
    reference = await collect(engine.generate("whole", prompt, params))
    stream = engine.generate("unread", prompt, params)
    tokens = list((await anext(stream)).new_token_ids)

    async def paused() -> bool:
        s = engine.stats
        return s.num_running == 0 and s.num_paused == 1 and engine.num_buffered_tokens >= bound

    await wait_for(paused, 120.0, "the unread request is paused, holding no seat")
    async for update in stream:
        tokens.extend(update.new_token_ids)
    assert tokens == reference.token_ids
    assert engine.stats.num_paused == 0 and engine.num_buffered_tokens == 0


async def a_prefix_is_lent_and_borrowed_or_refused_by_name(
    engine: ServingEngine, prompt: list[int]
) -> None:
    """Peer pull's engine side (docs/kv-cache.md): a lease pins the cached run and frees it
    exactly once; a borrow of what is cached writes nothing; a failed fill publishes nothing;
    every block comes back. An engine that cannot says so by name, on every call."""
    free = engine.stats.num_free_blocks
    k = (len(prompt) - 1) // engine.block_size

    async def never(first: int, block_ids: list[int]) -> int:
        raise AssertionError("nothing to write")

    try:
        assert await engine.lend_prefix("lease", prompt, 0, k) == []  # nothing cached yet
    except PeerPullUnsupported:
        with pytest.raises(PeerPullUnsupported):
            await engine.borrow_prefix("b", prompt, k, never)
        return
    await collect(engine.generate("plain", prompt, GREEDY))
    lent = await engine.lend_prefix("lease", prompt, 0, k)
    assert len(lent) == k and engine.stats.num_pinned == 1
    await engine.free_pinned("lease")
    with pytest.raises(KeyError):
        await engine.free_pinned("lease")  # exactly once
    assert await engine.borrow_prefix("cached", prompt, k, never) == 0
    await engine.give_back("cached")

    async def failing(first: int, block_ids: list[int]) -> int:
        assert (first, len(block_ids)) == (0, k)
        raise RuntimeError("the pull broke")

    other = [t + 1 for t in prompt]  # none of its blocks cached
    with pytest.raises(RuntimeError, match="the pull broke"):
        await engine.borrow_prefix("failed", other, k, failing)
    await engine.give_back("failed")
    assert await engine.lend_prefix("lease2", other, 0, k) == []  # nothing was published
    await settled(engine, free)


CASES: list[Case] = [
    prefilled_then_decoded_is_the_plain_run,
    a_continuation_gives_the_rest_of_the_run,
    a_failed_or_cancelled_fill_frees_its_blocks,
    a_full_cache_refuses_admission_by_name,
    leaving_a_stream_aborts_and_frees,
    stops_end_where_the_engine_says,
    logit_processing_decides_where_it_should,
    guided_outputs_hold_and_end_when_complete,
    prompt_logprobs_come_once_with_the_first_token,
    kv_events_name_the_prompt_blocks,
    an_unread_request_gives_up_its_seat_then_gets_every_token,
    a_prefix_is_lent_and_borrowed_or_refused_by_name,
]
