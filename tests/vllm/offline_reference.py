"""vLLM's own offline run, as the tests' independent reference: reads {model, prompts,
max_tokens, optional sampling: extra greedy SamplingParams such as penalties} as JSON on stdin,
prints per prompt the greedy tokens and, per token, the gap between
the two likeliest raw logprobs (the near-tie margin). Run as a script, in a process of its own."""

from __future__ import annotations

import json
import sys

from tests.vllm.conftest import BLOCK_SIZE


def main() -> None:
    spec = json.loads(sys.stdin.read())
    from vllm import LLM, SamplingParams

    extra = spec.get("sampling", {})
    llm = LLM(
        spec["model"],
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=512,
        enforce_eager=True,
        kv_cache_memory_bytes=32 << 20,
        seed=0,
        tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        # With penalties the near-tie margin is that of the logits the choice was made on.
        logprobs_mode="processed_logprobs" if extra else "raw_logprobs",
    )
    if "logit_bias" in extra:
        extra["logit_bias"] = {int(k): v for k, v in extra["logit_bias"].items()}
    params = SamplingParams(
        temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, logprobs=2, **extra
    )
    # One prompt at a time: batch shapes like the served path's.
    rows = []
    for prompt in spec["prompts"]:
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        completion = out.outputs[0]
        margins = []
        for position in completion.logprobs or []:
            top = sorted(lp.logprob for lp in position.values())[::-1]
            margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
        rows.append({"token_ids": list(completion.token_ids), "margins": margins})
    print("offline-reference: " + json.dumps(rows), flush=True)


if __name__ == "__main__":
    main()
