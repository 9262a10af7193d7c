"""Build tiny/small random-init Hugging Face checkpoints for tests and demos.

There is no model hub access, so every checkpoint the project uses is made here: a byte-level
BPE tokenizer trained on a bundled corpus plus a randomly initialised Llama/Qwen2/Qwen3 model.
Output is a normal HF directory (config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json) and is byte-for-byte reproducible for a given seed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MixtralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from engine.dtypes import DTYPE_NAMES, ModelDtype

# qwen3_moe and mixtral (MoE) are for the vLLM engine (the native engine refuses them by name).
ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
SIZES = ("tiny", "tiny64", "small")

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]

TOKENIZER_VOCAB = {"tiny": 1024, "tiny64": 1024, "small": 4096}
# ChatML, as SmolLM2, Qwen and others use it: the tiny models get a chat template too.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ROPE_THETA = 10000.0
# Small original context so the llama3 frequency scaling matters within the tiny 512 window.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# Shapes per size. "small" (~50M params) deliberately has a config vocab far larger than the
# tokenizer so that serving code cannot assume len(tokenizer) == vocab_size.
SHAPES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 512,
    },
    # tiny with head_dim 64: vLLM's CPU attention takes head sizes 32, 64, 80, ... only.
    "tiny64": {
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 256,
        "max_position_embeddings": 512,
    },
    "small": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 1408,
        "max_position_embeddings": 4096,
        "vocab_size": 32000,
    },
}
# qwen3 gets a head_dim != hidden/heads so code that derives head_dim from hidden_size breaks.
QWEN3_HEAD_DIM = {"tiny": 32, "tiny64": 64, "small": 128}
# Experts per MoE layer, and how many each token uses.
NUM_EXPERTS, EXPERTS_PER_TOKEN = 4, 2

# Output logit std ~= LOGIT_SCALE: with the 0.02 HF default the tiny model's logits have std
# ~0.16, a near-uniform distribution where any numeric noise flips greedy choices.
LOGIT_SCALE = 4.0
# Matrices use gain/sqrt(fan_in) so activations stay O(1) at any width. o_proj/down_proj get a
# large gain because with tied embeddings a dominant input embedding makes every token predict
# itself and greedy decoding repeats one token forever (measured on tiny qwen2/qwen3: gain 1 ->
# nearly every prompt loops on one token; gain 6 -> most prompts give varied output).
RESIDUAL_OUT_GAIN = 6.0
NORM_JITTER = 0.1
BIAS_STD = 0.1


def corpus_text() -> str:
    """The bundled English training text for the tokenizer."""
    # Path(__file__) rather than importlib.resources: the latter fails on namespace/editable
    # installs, while package-data keeps data/ next to this file in wheels too.
    return (Path(__file__).parent / "data" / "corpus.txt").read_text(encoding="utf-8")


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE with the exact Qwen2 pipeline (NFC, Qwen split regex, no BOS added).

    AutoTokenizer ignores tokenizer_config for model_type "qwen2" and rebuilds a Qwen2Tokenizer
    from vocab+merges with this pipeline; using it for every arch keeps tokenizer.json and
    AutoTokenizer producing identical ids.
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        # Full byte alphabet so any UTF-8 input is encodable, not just what the corpus contains.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(keepends=True), trainer=trainer)
    return tok


def build_config(
    arch: str,
    size: str,
    tokenizer_vocab_size: int,
    special_ids: dict[str, int],
    *,
    tie_word_embeddings: bool | None = None,
    rope_scaling: bool = False,
) -> PretrainedConfig:
    """HF config for arch/size; validates arguments like make_model."""
    _check_args(arch, size, rope_scaling)
    shape: dict[str, Any] = dict(SHAPES[size])
    shape.setdefault("vocab_size", -(-tokenizer_vocab_size // 8) * 8)
    if tie_word_embeddings is None:
        tie_word_embeddings = arch in ("qwen2", "qwen3")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": ROPE_THETA}
    if rope_scaling:
        rope.update(LLAMA3_ROPE)
    common: dict[str, Any] = {
        **shape,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie_word_embeddings,
        "rope_parameters": rope,
        "bos_token_id": special_ids[BOS_TOKEN],
        "eos_token_id": special_ids[EOS_TOKEN],
        "pad_token_id": special_ids[PAD_TOKEN],
    }
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=QWEN3_HEAD_DIM[size])
    moe: dict[str, Any] = {"num_experts_per_tok": EXPERTS_PER_TOKEN}
    moe_size = common["intermediate_size"] // 2
    if arch == "qwen3_moe":
        moe.update(num_experts=NUM_EXPERTS, moe_intermediate_size=moe_size)
        moe["head_dim"] = QWEN3_HEAD_DIM[size]
        return Qwen3MoeConfig(**common, **moe)
    moe.update(num_local_experts=NUM_EXPERTS, intermediate_size=moe_size)
    return MixtralConfig(**{**common, **moe})


def _check_args(arch: str, size: str, rope_scaling: bool) -> None:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if rope_scaling and arch != "llama":
        raise ValueError(f"rope_scaling is only supported for arch='llama', got arch={arch!r}")


@torch.no_grad()
def init_weights(model: PreTrainedModel, seed: int) -> None:
    """Re-initialise every parameter from one seeded generator.

    HF sets norms to 1 and biases to 0, which would hide bugs such as a dropped q_norm or
    bias; jittering them makes every parameter observable in the output.
    """
    gen = torch.Generator().manual_seed(seed)
    hidden = int(model.config.hidden_size)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("bias"):
            value = BIAS_STD * noise
        elif p.dim() == 1:
            value = 1.0 + NORM_JITTER * noise
        elif "embed_tokens" in name or "lm_head" in name:
            # Final hidden state has RMS ~1, so this gives logits with std ~LOGIT_SCALE.
            value = (LOGIT_SCALE / hidden**0.5) * noise
        elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            value = (RESIDUAL_OUT_GAIN / p.shape[-1] ** 0.5) * noise
        else:  # [.., out, in] (a MoE's experts stacked in front): fan-in is the last dim
            value = noise / p.shape[-1] ** 0.5
        p.copy_(value.to(p.dtype))


def make_model(
    out_dir: str | Path,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    *,
    dtype: str = "float32",
    tie_word_embeddings: bool | None = None,
    rope_scaling: bool = False,
) -> Path:
    """Write a random-init checkpoint + tokenizer to out_dir and return it as a Path."""
    _check_args(arch, size, rope_scaling)
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = train_tokenizer(TOKENIZER_VOCAB[size])
    vocab = tok.get_vocab()
    special_ids = {t: vocab[t] for t in SPECIAL_TOKENS}
    config = build_config(
        arch,
        size,
        tok.get_vocab_size(),
        special_ids,
        tie_word_embeddings=tie_word_embeddings,
        rope_scaling=rope_scaling,
    )

    # fork_rng: HF's own init draws from the global RNG; leave the caller's stream untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_weights(model, seed)
    model = model.to(ModelDtype(dtype).as_torch).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=special_ids[BOS_TOKEN],
        eos_token_id=special_ids[EOS_TOKEN],
        pad_token_id=special_ids[PAD_TOKEN],
    )
    model.save_pretrained(out)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        # Default clean-up rewrites " ." to "." and breaks exact decode(encode(x)) == x.
        clean_up_tokenization_spaces=False,
        model_max_length=int(config.max_position_embeddings),
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    _disable_default_unk(out / "tokenizer_config.json")
    return out


def _disable_default_unk(path: Path) -> None:
    # Qwen2Tokenizer (forced for model_type qwen2) otherwise invents an "<|endoftext|>" unk
    # token, growing the vocab by one; byte-level BPE never needs an unk token.
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg["unk_token"] = None
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")
