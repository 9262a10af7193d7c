"""What a benchmark sends: synthetic prompts, shared-prefix prompts, or a JSONL file.

Synthetic token ids are drawn from [16, 1000): valid for any vocabulary of 1000 tokens or more
and clear of the special ids at the bottom. Outputs ignore EOS, so every request generates
exactly its output length (the usual convention of serving benchmarks).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

TOKEN_LOW, TOKEN_HIGH = 16, 1000
# Chat requests whose greedy answers (SmolLM2-135M-Instruct) run past 64 tokens with no EOS:
# what quantized-cache agreement is judged on (benchmarks/kv_tiers.py, the real-model tests).
OPEN_ENDED_QUESTIONS = (
    "Explain how a refrigerator keeps food cold.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between a violin and a cello?",
    "Describe the water cycle to a ten-year-old.",
    "Write a letter to a friend describing your favourite city.",
    "Explain why the sky is blue, step by step.",
    "Give me a recipe for a simple vegetable soup.",
    "Tell me about the history of the printing press.",
)


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...] = ()
    prompt: str | None = None  # text instead of ids (JSONL workloads)
    output_len: int = 128

    def __post_init__(self) -> None:
        if (self.prompt is None) == (not self.prompt_token_ids):
            raise ValueError("a request needs exactly one of prompt and prompt_token_ids")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")

    @property
    def num_prompt_tokens(self) -> int:
        """Known for token-id prompts; text prompts report 0 (the router tokenizes them)."""
        return len(self.prompt_token_ids)


def _ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(n))


def synthetic(num: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """Independent random prompts: no prefix-cache hits."""
    rng = random.Random(seed)
    return [BenchRequest(_ids(rng, input_len), output_len=output_len) for _ in range(num)]


def shared_prefix(
    num: int, input_len: int, output_len: int, seed: int, num_prefixes: int = 4
) -> list[BenchRequest]:
    """Prompts that share one of ``num_prefixes`` system-prompt-like prefixes (3/4 of the
    prompt), then a unique suffix: what prefix caching and cache-aware routing are for."""
    rng = random.Random(seed)
    prefix_len = input_len * 3 // 4
    prefixes = [_ids(rng, prefix_len) for _ in range(num_prefixes)]
    return [
        BenchRequest(
            prefixes[i % num_prefixes] + _ids(rng, input_len - prefix_len), output_len=output_len
        )
        for i in range(num)
    ]


def from_jsonl(path: Path, num: int | None, default_output_len: int) -> list[BenchRequest]:
    """One JSON object per line: ``{"prompt": "..."}`` or ``{"prompt_token_ids": [...]}``,
    and optionally ``"output_len"``. Errors name the line."""
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            ids = item.get("prompt_token_ids") or ()
            if not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be integers")
            requests.append(
                BenchRequest(
                    tuple(ids),
                    item.get("prompt"),
                    int(item.get("output_len", default_output_len)),
                )
            )
        except (ValueError, AttributeError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests[:num] if num is not None else requests


def load(workload: str, num: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    if workload == "synthetic":
        return synthetic(num, input_len, output_len, seed)
    if workload == "shared-prefix":
        return shared_prefix(num, input_len, output_len, seed)
    path = Path(workload)
    if path.suffix != ".jsonl" or not path.is_file():
        raise ValueError(
            f"--workload must be synthetic, shared-prefix or a .jsonl file: {workload}"
        )
    return from_jsonl(path, num, output_len)


def poisson_arrivals(num: int, rate: float, seed: int) -> list[float]:
    """Send times of an open-loop run (``pdserve bench --rate`` and the simulator): gaps drawn
    from ``random.Random(seed)``'s exponential distribution."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(num):
        t += rng.expovariate(rate)
        arrivals.append(t)
    return arrivals
