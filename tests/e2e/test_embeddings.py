"""``/v1/embeddings`` through ``omni-serve`` (real processes, the official ``openai`` client): the tiny
Qwen3-Embedding-style model's vectors equal sentence-transformers' and the tiny Qwen3 chat model's
equal transformers' last hidden state (last token, L2-normalised: vLLM's decoder default), cosine
>= 0.9999, in float and base64, with Matryoshka ``dimensions``; one instance answers chat and
embeddings; bad input is a 400 naming the param and costs no prefill."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import requests
import torch

from omnirelay.deploy.builders.qwen3 import cached_qwen3
from omnirelay.deploy.builders.qwen3_embedding import cached_qwen3_embedding

from cluster import settled_workers
from conftest import ServeProcess

pytestmark = [pytest.mark.timeout(400)]

TEXTS = ["Hello there.", "The harbor town woke slowly, and the market opened at dawn.",
         "A good recipe is a small program: gather, measure, and follow each step in order.",
         "Computers store numbers as bits."]


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    log = tmp_path_factory.mktemp("embeddings") / "serve.log"
    server = ServeProcess(str(cached_qwen3_embedding()), str(cached_qwen3()), "--served-model-name", "emb",
                          "--served-model-name", "qwen3", log_path=str(log))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(serve):
    return openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _cosines(a, b) -> list[float]:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return [float(x @ y / np.linalg.norm(x) / np.linalg.norm(y)) for x, y in zip(a, b)]


def _sentence_transformers(texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(str(cached_qwen3_embedding()), device="cpu").encode(texts, convert_to_numpy=True)


def _hf_last_token(path, texts: list[str]) -> np.ndarray:
    """transformers' final hidden state of each text's last token, L2-normalised (vLLM's decoder default)."""
    from transformers import AutoModel, AutoTokenizer
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = [model(torch.tensor([tok(t)["input_ids"]])).last_hidden_state[0, -1] for t in texts]
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1).numpy()


def _prefilled_tokens(serve) -> int:
    return sum(w["stats"].get("prefill_tokens", 0) for w in settled_workers(serve.url) if w["role"] == "prefill")


def test_vectors_equal_sentence_transformers_float_and_base64(client):
    reference = _sentence_transformers(TEXTS)
    as_float = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float")
    as_base64 = client.embeddings.create(model="emb", input=TEXTS)   # the client asks for base64 and decodes it
    assert [d.index for d in as_float.data] == list(range(len(TEXTS)))
    for answer in (as_float, as_base64):
        assert min(_cosines([d.embedding for d in answer.data], reference)) >= 0.9999
    assert [d.embedding for d in as_float.data] == [d.embedding for d in as_base64.data]
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(cached_qwen3_embedding())
    ids = [tok(t)["input_ids"] for t in TEXTS]
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == sum(map(len, ids))
    by_ids = client.embeddings.create(model="emb", input=ids, encoding_format="float")
    one = client.embeddings.create(model="emb", input=ids[1], encoding_format="float")
    assert min(_cosines([d.embedding for d in by_ids.data], reference)) >= 0.9999
    assert _cosines([one.data[0].embedding], reference[1:2])[0] >= 0.9999


def test_matryoshka_dimensions(client):
    reference = _sentence_transformers(TEXTS)[:, :64]
    answer = client.embeddings.create(model="emb", input=TEXTS, dimensions=64)
    vectors = np.array([d.embedding for d in answer.data])
    assert vectors.shape == (len(TEXTS), 64)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)   # truncated, then renormalised
    assert min(_cosines(vectors, reference)) >= 0.9999


def test_chat_model_embeds_and_chats_in_one_instance(client):
    path = cached_qwen3()
    reference = _hf_last_token(path, TEXTS)
    answer = client.embeddings.create(model="qwen3", input=TEXTS, encoding_format="float")
    assert min(_cosines([d.embedding for d in answer.data], reference)) >= 0.9999
    chat = client.chat.completions.create(model="qwen3", messages=[{"role": "user", "content": "Hi!"}],
                                          max_tokens=4, temperature=0)
    assert chat.usage.completion_tokens >= 1
    cards = {m.id: m.model_extra for m in client.models.list().data}
    assert cards["qwen3"]["tasks"] == ["generate", "embed", "score"]
    assert cards["qwen3"]["pooler"]["pooling_type"] == "LAST" and cards["qwen3"]["pooler"]["source"] == "default"
    assert cards["emb"]["pooler"]["source"] == "modules.json"


def test_many_inputs_in_bounded_waves(client):
    texts = [f"item number {i} of a long list" for i in range(100)]   # more than one wave in flight
    answer = client.embeddings.create(model="emb", input=texts, encoding_format="float")
    assert [d.index for d in answer.data] == list(range(100))
    assert min(_cosines([d.embedding for d in answer.data], _sentence_transformers(texts))) >= 0.9999


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input[0]"),
    ({"input": []}, "input"),
    ({"input": ["ok"] * 10_000}, "input"),
    ({"input": ["fine", "word " * 5000]}, "input[1]"),
    ({"input": [[1, 2, 10 ** 6]]}, "input"),
    ({"input": "hi", "encoding_format": "float16"}, "encoding_format"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 4096}, "dimensions"),
    ({"input": "hi", "model": "qwen3", "dimensions": 64}, "dimensions"),   # no Matryoshka declared
])
def test_bad_input_is_a_400_naming_the_param_and_computes_nothing(serve, body, param):
    before = _prefilled_tokens(serve)
    answer = requests.post(serve.url + "/v1/embeddings", json={"model": "emb", **body}, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    # The count moves by exactly a good request's tokens: the bad one prefilled nothing.
    good = requests.post(serve.url + "/v1/embeddings", json={"model": "emb", "input": "fine"}, timeout=60).json()
    assert _prefilled_tokens(serve) == before + good["usage"]["prompt_tokens"]


def test_unserved_option_is_a_422(serve):
    answer = requests.post(serve.url + "/v1/embeddings",
                           json={"model": "emb", "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert answer.status_code == 422 and answer.json()["error"]["param"] == "messages"


def test_langchain_openai_embeddings(serve):
    from langchain_openai import OpenAIEmbeddings
    client = OpenAIEmbeddings(model="emb", base_url=serve.url + "/v1", api_key="unused",
                              check_embedding_ctx_length=False, max_retries=0)
    reference = _sentence_transformers(TEXTS)
    assert min(_cosines(client.embed_documents(TEXTS), reference)) >= 0.9999
    assert _cosines([client.embed_query(TEXTS[2])], reference[2:3])[0] >= 0.9999
