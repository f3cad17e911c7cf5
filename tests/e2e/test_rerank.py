"""``/v1/rerank`` and ``/v1/score`` through ``omni-serve``: a decoder-only reranker (the tiny
Qwen3-Reranker-style model) scores each (query, document) as transformers does following its model
card -- the probability of "yes" against "no" at the last token -- within 1e-4, ordered and cut at
``top_n`` as Jina's and Cohere's clients post it; an embedding model scores by cosine; bad input is a
400 naming the param."""

from __future__ import annotations

import numpy as np
import pytest
import requests
import torch

from omnirelay.deploy.builders.qwen3_embedding import cached_qwen3_embedding, cached_qwen3_reranker
from omnirelay.gateway.scoring import DEFAULT_INSTRUCTION, RERANK_PREFIX, RERANK_SUFFIX

from conftest import ServeProcess

pytestmark = [pytest.mark.timeout(400)]

QUERY = "Where do the fishing boats come back to?"
DOCUMENTS = ["The harbor town woke slowly.", "Heat the pan and melt the butter.",
             "Computers store numbers as bits.", "Fishing boats came back before dawn."]


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    log = tmp_path_factory.mktemp("rerank") / "serve.log"
    server = ServeProcess(str(cached_qwen3_reranker()), str(cached_qwen3_embedding()), "--served-model-name",
                          "reranker", "--served-model-name", "emb", log_path=str(log))
    yield server
    server.stop()


def _card_scores(query: str, documents: list[str], instruction: str = DEFAULT_INSTRUCTION) -> list[float]:
    """Qwen3-Reranker's model card, in transformers: the last token's (no, yes) logits → P(yes)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = cached_qwen3_reranker()
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    no, yes = tok.convert_tokens_to_ids(["no", "yes"])
    scores = []
    with torch.no_grad():
        for doc in documents:
            text = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
            ids = (tok(RERANK_PREFIX, add_special_tokens=False)["input_ids"] + tok(text, add_special_tokens=False)["input_ids"]
                   + tok(RERANK_SUFFIX, add_special_tokens=False)["input_ids"])
            logits = model.eval()(torch.tensor([ids])).logits[0, -1]
            scores.append(torch.softmax(logits[[no, yes]].double(), dim=0)[1].item())
    return scores


def test_rerank_as_jina_and_cohere_post_it(serve):
    reference = _card_scores(QUERY, DOCUMENTS)
    answer = requests.post(serve.url + "/v1/rerank", json={"model": "reranker", "query": QUERY, "documents": DOCUMENTS,
                                                           "top_n": 3, "return_documents": True}, timeout=120).json()
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -reference[i])[:3]
    assert [r["index"] for r in answer["results"]] == order
    for result in answer["results"]:
        assert abs(result["relevance_score"] - reference[result["index"]]) <= 1e-4
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    assert answer["usage"]["total_tokens"] > 0
    cohere = requests.post(serve.url + "/v2/rerank", json={"model": "reranker", "query": QUERY,
                                                           "documents": [{"text": d} for d in DOCUMENTS],
                                                           "return_documents": False}, timeout=120).json()
    assert len(cohere["results"]) == len(DOCUMENTS) and "document" not in cohere["results"][0]
    assert all(abs(r["relevance_score"] - reference[r["index"]]) <= 1e-4 for r in cohere["results"])


def test_score_pairs(serve):
    reference = _card_scores(QUERY, DOCUMENTS[:2])
    answer = requests.post(serve.url + "/v1/score", json={"model": "reranker", "text_1": QUERY,
                                                          "text_2": DOCUMENTS[:2]}, timeout=120).json()
    assert [d["index"] for d in answer["data"]] == [0, 1]
    assert all(abs(d["score"] - r) <= 1e-4 for d, r in zip(answer["data"], reference))
    from sentence_transformers import SentenceTransformer
    vectors = SentenceTransformer(str(cached_qwen3_embedding()), device="cpu").encode([QUERY, DOCUMENTS[3]])
    cosine = float(vectors[0] @ vectors[1] / np.linalg.norm(vectors[0]) / np.linalg.norm(vectors[1]))
    by_embedding = requests.post(serve.url + "/score", json={"model": "emb", "text_1": [QUERY],
                                                             "text_2": [DOCUMENTS[3]]}, timeout=120).json()
    assert abs(by_embedding["data"][0]["score"] - cosine) <= 1e-4


@pytest.mark.parametrize("route, body, status, param", [
    ("/v1/rerank", {"documents": ["a"]}, 400, "query"),
    ("/v1/rerank", {"query": "q", "documents": []}, 400, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a", ""]}, 400, "documents[1]"),
    ("/v1/rerank", {"query": "q", "documents": ["a"] * 3000}, 400, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a", "word " * 5000]}, 400, "documents[1]"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, 400, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "max_tokens_per_doc": 8}, 422, "max_tokens_per_doc"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "text_2"),
])
def test_bad_input(serve, route, body, status, param):
    answer = requests.post(serve.url + route, json={"model": "reranker", **body}, timeout=60)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param
