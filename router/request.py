"""The router's own request: what both public frontends build (the gRPC servicer through
``router/grpc_wire.py``, the OpenAI app through ``router/openai/serving.py``) and everything
between them and the workers reads: the request core, the plan, each attempt. The public
formats are made only at their own edges; a request's worker calls carry its sampling
serialised once (``router/generation.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from router.request_class import Slo, Tenant


@dataclass(frozen=True)
class Request:
    """One public request (for the OpenAI API: one choice). A frontend builds it with the
    client's prompt, text or ids (exactly one, ``RequestCore.read`` checks);
    ``RequestCore.read`` returns it validated, its prompt as ids."""

    client_id: str  # the client's request id (or a fresh one): in its final and its logs
    params: SamplingParams
    caller: str  # who sends it, as strikes count it (``RequestCore.caller``)
    start_s: float  # time.perf_counter() when it arrived: TTFT starts here
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] = ()
    # False: the prompt is a rendered chat template, which wrote its own special tokens.
    add_special_tokens: bool = True
    # Flow control (docs/slo.md): whose it is, and what it asks of its class.
    tenant: Tenant | None = None  # None: its caller's, with no API key attributes
    service_class: str | None = None  # None: its API key's default class, else the router's
    priority: int | None = None  # None: its class's (lower is served first, as vLLM)
    slo: Slo = field(default_factory=Slo)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
