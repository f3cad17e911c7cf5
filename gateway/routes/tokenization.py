"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the served model's tokenizer, no worker involved.

Shapes (vLLM's ``TokenizeCompletionRequest`` / ``TokenizeChatRequest`` / ``DetokenizeRequest``)::

    /tokenize    {model?, prompt, add_special_tokens = true, return_token_strs = false}
                 {model?, messages, add_generation_prompt = true, continue_final_message = false,
                  add_special_tokens = false, chat_template_kwargs?, chat_template?, return_token_strs = false}
              → {count, max_model_len, tokens, token_strs}     (token_strs: null unless asked)
    /detokenize  {model?, tokens} → {prompt}

``model`` may be left out when the gateway serves exactly one text model (as vLLM serves one).
A chat body is templated exactly as ``/v1/chat/completions`` templates it, so with the defaults its
``count`` is that request's ``usage.prompt_tokens``; a ``/v1/completions`` prompt is tokenized
without special tokens, which ``add_special_tokens: false`` reproduces. Bad input → 400 naming the
param; an unknown model → 404; the template switches as chat takes them (gateway/schema.py
``template_options``: a request's own ``chat_template`` only with ``--trust-request-chat-template``,
else 422); ``tools`` and media parts → 422.

With an API key configured these routes need it like ``/v1`` (gateway/middleware.py ``authenticate``): tokenizing costs
the gateway CPU.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from omnirelay.errors import BadRequest, Unprocessable

from ..app_keys import CONFIG, MODELS, SPOKEN_ANSWERS
from ..cpu_work import off_loop
from ..models import ModelRuntime, text_model
from ..request_body import json_body
from ..sampling_options import check_vocab
from ..schema import boolean_field, chat_messages, check_request_template, template_options, token_ids_field
from ..spoken_answers import SpokenAnswers, resolve_audio_turns

_UNSERVED_CHAT_OPTIONS = ("tools", "mm_processor_kwargs")


def add_tokenize_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)


def _runtime(request: web.Request, body: Any) -> ModelRuntime:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    name = body.get("model")
    if name is None:
        text = [n for n, m in request.app[MODELS].items() if isinstance(m, ModelRuntime)]
        if len(text) != 1:
            raise BadRequest(f"'model' is required: this server has {len(text)} text models", param="model")
        name = text[0]
    if not isinstance(name, str) or not name:
        raise BadRequest("'model' must be a non-empty string", param="model")
    return text_model(request.app[MODELS], name)


def tokenize_body(model: ModelRuntime, body: dict, trusted: bool = False,
                  answers: SpokenAnswers | None = None) -> dict:
    """The answer to one ``/tokenize`` body (validated here: 400/422 naming the param). ``answers``:
    the transcripts an assistant turn given by its audio id reads as (as chat does)."""
    if ("prompt" in body) == ("messages" in body):
        raise BadRequest("give either 'prompt' or 'messages' (exactly one)", param="prompt")
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise BadRequest("'prompt' must be a string", param="prompt")
        add_special = boolean_field(body, "add_special_tokens", True)
        tokens = list(model.tokenizer(prompt, add_special_tokens=add_special)["input_ids"]) if prompt else []
    else:
        for name in _UNSERVED_CHAT_OPTIONS:
            if body.get(name) is not None:
                raise Unprocessable(f"'{name}' is not supported by this server's /tokenize", param=name)
        messages = resolve_audio_turns(chat_messages(body), answers or SpokenAnswers())
        for i, message in enumerate(messages):
            if not isinstance(message["content"], str):
                raise Unprocessable(f"messages[{i}].content: /tokenize takes text messages",
                                    param=f"messages[{i}].content")
        template = template_options(body)
        check_request_template(template, trusted)
        tokens = model.encode_chat(messages, None, template)
    strs = model.tokenizer.convert_ids_to_tokens(tokens) if boolean_field(body, "return_token_strs") else None
    return {"count": len(tokens), "max_model_len": model.max_model_len, "tokens": tokens, "token_strs": strs}


def detokenize_body(model: ModelRuntime, body: dict) -> dict:
    if not isinstance(body.get("tokens"), list):
        raise BadRequest("'tokens' must be a list of token ids", param="tokens")
    tokens = list(token_ids_field(body["tokens"], "tokens"))
    check_vocab(tokens, model.vocab_size, "tokens")
    return {"prompt": model.tokenizer.decode(tokens)}


async def tokenize(request: web.Request) -> web.Response:
    body = await json_body(request)
    # Off the event loop: the tokenizer's work, and the JSON of its answer, grow with the prompt.
    answer = await off_loop(request.app, lambda: json.dumps(tokenize_body(
        _runtime(request, body), body, request.app[CONFIG].trust_request_chat_template,
        request.app[SPOKEN_ANSWERS])))
    return web.Response(text=answer, content_type="application/json")


async def detokenize(request: web.Request) -> web.Response:
    body = await json_body(request)
    return web.json_response(detokenize_body(_runtime(request, body), body))
