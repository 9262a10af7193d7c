"""Protobuf <-> engine dataclasses: where the wire vocabulary meets the engine's (the KV
handle's conversion belongs to ``kvtransfer.wire``).

Validation errors raise ``ValueError`` whose message names the field; servicers turn them into
``INVALID_ARGUMENT``.
"""

from __future__ import annotations

from engine.kv_layout import NATIVE_PAGE_LAYOUT, KVCacheDtype, KVCacheLayout
from engine.outputs import EngineStats
from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprobs
from engine.structured_output import StructuredKind, StructuredOutput
from pdserve.common.wire_version import WIRE_VERSION
from pdserve.v1 import common_pb2

_FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
_FINISH_NAMES = {v: k for k, v in _FINISH_REASONS.items()}
_STRUCTURED_KINDS = {
    StructuredKind.JSON_SCHEMA: common_pb2.STRUCTURED_KIND_JSON_SCHEMA,
    StructuredKind.JSON_OBJECT: common_pb2.STRUCTURED_KIND_JSON_OBJECT,
    StructuredKind.REGEX: common_pb2.STRUCTURED_KIND_REGEX,
    StructuredKind.CHOICE: common_pb2.STRUCTURED_KIND_CHOICE,
}
_STRUCTURED_NAMES = {v: k for k, v in _STRUCTURED_KINDS.items()}
_OPTIONAL_INTS = (
    "max_tokens",
    "top_k",
    "seed",
    "logprobs",
    "min_tokens",
    "prompt_logprobs",
    "priority",
)
_OPTIONAL_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields keep the engine defaults; SamplingParams validates the rest."""
    kwargs: dict[str, object] = {}
    for name in _OPTIONAL_INTS + _OPTIONAL_FLOATS:
        if msg.HasField(name):  # type: ignore[arg-type]
            kwargs[name] = getattr(msg, name)
    return SamplingParams(
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logit_bias=dict(msg.logit_bias),
        structured=_structured_from_proto(msg),
        bad_words=[list(word.token_ids) for word in msg.bad_words] or None,
        **kwargs,  # type: ignore[arg-type]
    )


def _structured_from_proto(msg: common_pb2.SamplingParams) -> StructuredOutput | None:
    if not msg.HasField("structured"):
        return None
    return structured_from_proto(msg.structured)


def structured_from_proto(msg: common_pb2.StructuredOutput) -> StructuredOutput:
    kind = _STRUCTURED_NAMES.get(msg.kind)
    if kind is None:
        raise ValueError(f"structured.kind {msg.kind} is not a known kind")
    return StructuredOutput(kind, msg.spec, msg.field or "structured")


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        stop=list(params.stop_strings),
        stop_token_ids=list(params.stop_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.priority:  # 0 stays unset: a plain request's bytes do not change
        msg.priority = params.priority
    if params.processes_logits:  # defaults stay unset: a plain request's bytes do not change
        msg.presence_penalty = params.presence_penalty
        msg.frequency_penalty = params.frequency_penalty
        msg.repetition_penalty = params.repetition_penalty
        msg.min_tokens = params.min_tokens
        msg.logit_bias.update(dict(params.bias))
        msg.bad_words.extend(common_pb2.TokenIds(token_ids=w) for w in params.bad_words or ())
    if params.structured is not None:
        msg.structured.CopyFrom(structured_to_proto(params.structured))
    return msg


def structured_to_proto(so: StructuredOutput) -> common_pb2.StructuredOutput:
    return common_pb2.StructuredOutput(
        kind=_STRUCTURED_KINDS[so.kind], spec=so.spec, field=so.field
    )


def logprobs_to_proto(lp: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top_token_ids=list(lp.top_token_ids),
        top_logprobs=list(lp.top_logprobs),
    )


def logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        token_id=msg.token_id,
        logprob=msg.logprob,
        top_token_ids=tuple(msg.top_token_ids),
        top_logprobs=tuple(msg.top_logprobs),
    )


def finish_reason_to_proto(reason: str | None) -> common_pb2.FinishReason.ValueType:
    return _FINISH_REASONS[reason] if reason else common_pb2.FINISH_REASON_UNSPECIFIED


def finish_reason_from_proto(value: common_pb2.FinishReason.ValueType) -> str | None:
    return _FINISH_NAMES.get(value)


def layout_to_proto(layout: KVCacheLayout) -> common_pb2.KVCacheLayout:
    return common_pb2.KVCacheLayout(
        model_fingerprint=layout.model_fingerprint,
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        kv_cache_dtype=layout.kv_cache_dtype.value,
        page_layout=layout.page_layout,
        tp_size=layout.tp_size,
        tp_rank=layout.tp_rank,
    )


def layout_from_proto(msg: common_pb2.KVCacheLayout) -> KVCacheLayout:
    return KVCacheLayout(
        model_fingerprint=msg.model_fingerprint,
        dtype=msg.dtype,
        block_size=msg.block_size,
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        kv_cache_dtype=KVCacheDtype.parse(msg.kv_cache_dtype or "auto"),
        page_layout=msg.page_layout or NATIVE_PAGE_LAYOUT,
        tp_size=msg.tp_size or 1,
        tp_rank=msg.tp_rank,
    )


def stats_to_proto(
    stats: EngineStats,
    layout: KVCacheLayout,
    *,
    block_size: int,
    max_model_len: int,
    num_inflight: int,
    draining: bool,
    engine_stalled_s: float = 0.0,
) -> common_pb2.WorkerStats:
    return common_pb2.WorkerStats(
        num_waiting=stats.num_waiting,
        num_running=stats.num_running,
        num_paused=stats.num_paused,
        num_pinned=stats.num_pinned,
        num_blocks=stats.num_blocks,
        num_free_blocks=stats.num_free_blocks,
        num_cached_blocks=stats.num_cached_blocks,
        num_prompt_tokens_computed=stats.num_prompt_tokens_computed,
        num_prefix_hit_tokens=stats.num_prefix_hit_tokens,
        block_size=block_size,
        max_model_len=max_model_len,
        num_inflight=num_inflight,
        draining=draining,
        layout=layout_to_proto(layout),
        engine_stalled_s=engine_stalled_s,
        wire_version=WIRE_VERSION,
    )


def remote_layout_mismatch(local: KVCacheLayout, msg: common_pb2.KVCacheLayout) -> str | None:
    """None when a peer's layout matches ours, else why not (a layout that cannot even be
    read, such as an unknown cache dtype, is a mismatch too, never an exception)."""
    try:
        remote = layout_from_proto(msg)
    except ValueError as exc:
        return f"remote layout refused: {exc}"
    return local.mismatch(remote)
