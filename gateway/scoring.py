"""Relevance scores of (query, document) pairs, for ``/v1/score`` and ``/v1/rerank`` (gateway/routes/rerank.py).

Two ways a served model scores, both prefill-only pooling requests (gateway/pooling_run.py):

* a **decoder-only reranker** (``ModelRuntime.rerank_token_ids``: Qwen3-Reranker, its ``config.json``
  naming ``classifier_from_token`` with ``is_original_qwen3_reranker`` as vLLM's overrides do): each
  pair is written into the prompt its model card gives (:func:`reranker_prompt`: the system turn that
  asks for "yes" or "no", the instruction, query and document, an empty thinking block) and scored
  as the probability of "yes" against "no" at the last token (``PoolingParams.label_token_ids``);
* **any other model that embeds**: the cosine similarity of the two texts' embeddings (vLLM's score
  for embedding models), each distinct text embedded once.

Texts are the client's: control tokens typed in them are plain text (gateway/control_tokens.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from omnirelay.errors import BadRequest
from omnirelay.pooling_params import PoolingParams

from .bus import BusClient
from .models import ModelRuntime
from .pooling_run import pool_prompts

# Qwen3-Reranker's prompt, as its model card writes it.
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                 "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclasses.dataclass
class ScorePlan:
    """What scoring ``pairs`` submits: ``prompts`` (token ids) and, per pair, which prompts' results
    make its score (one for a reranker, two embeddings otherwise)."""

    prompts: list[list[int]]
    pairs: list[tuple[int, ...]]
    reranker: bool


def reranker_prompt(model: ModelRuntime, query: str, document: str, instruction: str = DEFAULT_INSTRUCTION) -> list[int]:
    body = model.encode_client_text(f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}")
    return model.encode_text(RERANK_PREFIX) + body + model.encode_text(RERANK_SUFFIX)


def plan(model: ModelRuntime, pairs: list[tuple[str, str]], param: Callable[[int, int], str],
         instruction: str | None = None) -> ScorePlan:
    """Tokenize the pairs (CPU work: on the pool) and check each prompt fits the context: a 400
    naming ``param(i, side)`` (pair ``i``'s query, side 0, or document, side 1) for the first that
    does not (a reranker's prompt holds both: it names the document)."""
    if model.rerank_token_ids:
        prompts = [reranker_prompt(model, q, d, instruction or DEFAULT_INSTRUCTION) for q, d in pairs]
        scored = [(i,) for i in range(len(prompts))]
        where = [param(i, 1) for i in range(len(pairs))]
    else:
        if instruction is not None:
            raise BadRequest("'instruction' is read by decoder-only rerankers only", param="instruction")
        texts: dict[str, int] = {}
        scored = [(texts.setdefault(q, len(texts)), texts.setdefault(d, len(texts))) for q, d in pairs]
        prompts = [list(model.tokenizer(t, add_special_tokens=True)["input_ids"]) for t in texts]
        where = [""] * len(prompts)
        for i, pair in reversed(list(enumerate(scored))):   # each text named by its first pair
            for side, index in enumerate(pair):
                where[index] = param(i, side)
    for ids, name in zip(prompts, where):
        if len(ids) > model.max_model_len:
            raise BadRequest(f"This model's maximum context length is {model.max_model_len} tokens. However, "
                             f"{name} makes a prompt of {len(ids)} tokens. Please reduce the length of the input.",
                             param=name)
    return ScorePlan(prompts, scored, bool(model.rerank_token_ids))


async def score(bus: BusClient, model: ModelRuntime, scoring: ScorePlan, deadline: float,
                request_id: str) -> list[float]:
    """Each pair's score, in order (a reranker's probability of "yes"; else the embeddings' cosine)."""
    if scoring.reranker:
        params = PoolingParams(normalize=False, label_token_ids=model.rerank_token_ids)
    else:
        params = model.pooler.params(normalize=True)
    results = await pool_prompts(bus, model.base_name, scoring.prompts, params, deadline, request_id)
    vectors = [np.frombuffer(r, dtype="<f4").astype(np.float64) for r in results]
    if scoring.reranker:
        return [float(vectors[i][-1]) for (i,) in scoring.pairs]
    return [float(vectors[a] @ vectors[b] / max(np.linalg.norm(vectors[a]) * np.linalg.norm(vectors[b]), 1e-12))
            for a, b in scoring.pairs]
