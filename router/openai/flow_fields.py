"""The OpenAI request body's flow control fields (docs/slo.md), checked: vLLM's ``priority``,
OpenAI's ``service_tier`` (a request class's name) and pdserve's ``slo`` targets. Pure; the
class's existence is the request core's check (``RequestCore.tag``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from engine.sampling_params import InvalidField, check_priority
from router.openai.invalid_parameter import InvalidParameter
from router.request_class import Slo

# ``service_tier`` values OpenAI's clients send that name no class of pdserve's.
ANY_TIER = ("auto", "default")
MAX_TIER_CHARS = 64


class SloTargets(BaseModel):
    """pdserve's extra: a request's own targets, over its class's."""

    model_config = ConfigDict(extra="ignore", strict=True)
    ttft_s: float | None = None
    tpot_s: float | None = None


def flow_fields(
    priority: int | None, service_tier: str | None, slo: SloTargets | None
) -> dict[str, Any]:
    """``ParsedRequest``'s ``priority``, ``service_class`` and ``slo``. Raises
    ``InvalidParameter`` naming the field."""
    if priority is not None:
        check_priority(priority)
    if service_tier is not None and not 0 < len(service_tier) <= MAX_TIER_CHARS:
        message = f"service_tier must be 1 to {MAX_TIER_CHARS} characters"
        raise InvalidParameter("service_tier", message)
    targets = slo or SloTargets()
    try:
        own = Slo(targets.ttft_s, targets.tpot_s)
    except InvalidField as exc:
        raise InvalidParameter(f"slo.{exc.field}", f"slo.{exc}") from None
    return {
        "priority": priority,
        "service_class": None if service_tier in ANY_TIER else service_tier,
        "slo": own,
    }
