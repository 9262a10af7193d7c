"""lm-evaluation-harness, unchanged, against ``pdserve`` disaggregated: ``local-completions``
scores a multiple-choice task by loglikelihood (``echo`` with ``logprobs`` over the prompt:
the prefill worker's prompt logprobs), and ``local-chat-completions`` runs a generate_until
task. The loglikelihoods equal HF transformers' within 1e-4. The tasks are local JSONL files
written here (no hub access)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from app.local_cluster import LocalCluster
from tests.engine.hf_reference import hf_logits, load_hf
from tests.services.harness import openai_cluster

pytestmark = pytest.mark.slow

MODEL = "tiny-eval"
DOCS = [
    {"question": "The sky is", "choices": [" blue", " green", " made of cheese"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {
        "question": "Water boils at",
        "choices": [" 100 degrees", " 10 degrees", " noon"],
        "answer": 0,
    },
]
MC_TASK = """\
task: pdserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """\
task: pdserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def cluster(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with openai_cluster(llama_dir, tmp_path_factory.mktemp("logs"), MODEL) as c:
        yield c


def _run_lm_eval(tmp_path: Path, model: str, model_args: str, *extra: str) -> None:
    flags = {
        "--model": model,
        "--model_args": f"model={MODEL},max_retries=1,num_concurrent=1,{model_args}",
        "--include_path": str(tmp_path),
        "--output_path": str(tmp_path / "out"),
    }
    command = [sys.executable, "-m", "lm_eval", *(x for kv in flags.items() for x in kv)]
    command += ["--log_samples", *extra]
    env = {
        **os.environ,
        "OPENAI_API_KEY": "none",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
    }
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def _samples(out: Path, task: str) -> list[dict[str, Any]]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_loglikelihoods_are_hfs_and_generation_runs(
    cluster: LocalCluster, llama_dir: Path, tmp_path: Path
) -> None:
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "mc.yaml").write_text(MC_TASK.format(data=data))
    (tmp_path / "gen.yaml").write_text(GEN_TASK.format(data=data))
    url = cluster.http_url
    completions = (
        f"base_url={url}/v1/completions,tokenizer={llama_dir},tokenizer_backend=huggingface,"
        "tokenized_requests=True"
    )
    _run_lm_eval(tmp_path, "local-completions", completions, "--tasks", "pdserve_mc")
    chat = f"base_url={url}/v1/chat/completions,tokenized_requests=False"
    _run_lm_eval(
        tmp_path, "local-chat-completions", chat, "--tasks", "pdserve_gen", "--apply_chat_template"
    )

    encoder = LocalCompletionsAPI(
        base_url=f"{url}/v1/completions",
        tokenizer=str(llama_dir),
        tokenizer_backend="huggingface",
        tokenized_requests=True,
    )
    hf = load_hf(llama_dir)
    scored = _samples(tmp_path / "out", "pdserve_mc")
    assert len(scored) == len(DOCS)
    checked = 0
    for sample in scored:
        arguments = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        for (context, continuation), ((loglikelihood, _),) in zip(
            arguments, sample["resps"], strict=True
        ):
            context_ids, continuation_ids = encoder._encode_pair(context, continuation)
            ids = context_ids + continuation_ids
            logp = torch.log_softmax(hf_logits(hf, ids), dim=-1)
            want = sum(
                float(logp[len(context_ids) - 1 + k, t]) for k, t in enumerate(continuation_ids)
            )
            assert abs(float(loglikelihood) - want) <= 1e-4, (context, continuation)
            checked += 1
    assert checked == sum(len(d["choices"]) for d in DOCS)
    generated = _samples(tmp_path / "out", "pdserve_gen")
    assert len(generated) == len(DOCS)
    assert all(isinstance(s["resps"][0][0], str) for s in generated)
