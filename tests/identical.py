"""One rule for "this run gives what one plain engine gives": equal tokens, text and finish
reason; a first difference is accepted only where the reference's own choice was a near-tie
(margin <= NEAR_TIE: two forward paths may round it either way), and then it is reported."""

from __future__ import annotations

from engine import SamplingParams
from engine.outputs import RequestOutput
from native_engine import LLM
from native_engine.diagnostics import NEAR_TIE, first_difference, sampler_choice


def same_or_near_tie(
    llm: LLM,
    prompt: list[int],
    token_ids: list[int],
    text: str,
    finish_reason: str | None,
    ref: RequestOutput,
    params: SamplingParams,
    label: str,
) -> str | None:
    """Asserts the run matches ``ref``; returns a report when a near-tie explains a difference."""
    if token_ids == ref.token_ids:
        assert text == ref.text, f"{label}: same tokens, different text"
        assert finish_reason == ref.finish_reason, f"{label}: finish reason"
        return None
    at = first_difference(token_ids, ref.token_ids)
    margin = sampler_choice(llm.engine, prompt, ref.token_ids, at, params).margin
    assert margin <= NEAR_TIE, (
        f"{label} differs from one engine at output {at} (margin {margin:.3g}): "
        f"{token_ids[at : at + 5]} vs {ref.token_ids[at : at + 5]}"
    )
    return f"{label}: near-tie at output {at} (margin {margin:.2g}), not a bug"


def compare_outputs(
    llm: LLM,
    outputs: list[RequestOutput],
    references: list[RequestOutput],
    params: list[SamplingParams],
) -> list[str]:
    """``same_or_near_tie`` for every output of a batch (logprobs too, where asked)."""
    reports = []
    for i, (out, ref, p) in enumerate(zip(outputs, references, params, strict=True)):
        report = same_or_near_tie(
            llm, ref.prompt_token_ids, out.token_ids, out.text, out.finish_reason, ref, p,
            f"request {i}",
        )  # fmt: skip
        if report is not None:
            reports.append(report)
            continue
        for got, want in zip(out.logprobs, ref.logprobs, strict=True):
            assert got.token_id == want.token_id
            assert abs(got.logprob - want.logprob) < 1e-4, f"request {i}: logprob"
            assert (
                got.top_token_ids == want.top_token_ids
                or max(abs(a - b) for a, b in zip(got.top_logprobs, want.top_logprobs, strict=True))
                < 1e-4
            ), f"request {i}: top logprobs"
    return reports
