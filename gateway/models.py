"""What the gateway knows about each served model: tokenizer, chat template, context length and
the stages of its pipeline. Loaded once at start-up from the model directory. And the lookup of a
request's ``model`` in the served table (:func:`served_model`)."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import TypeVar

from jinja2 import TemplateError
from transformers import AutoTokenizer

from omnirelay.errors import BadRequest, NotFound, Unprocessable
from omnirelay.model_kind import ModelKind, model_kind
from omnirelay.pooling_params import PoolerConfig, reranker_label_tokens, resolve_pooler_config

from .config import ServedModel
from .control_tokens import ContentTokens, strip_marks
from .media import MediaLimits, MediaProcessor
from .schema import STANDARD_ROLES, TemplateOptions
from .speech_facts import SpeechFacts

log = logging.getLogger("omnirelay.gateway")


# Names apply_chat_template takes for itself (and the conversation): not template variables a request may set.
_RENDER_ARGUMENTS = frozenset({"messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                               "continue_final_message", "tokenize", "sanitize_control_tokens", "padding",
                               "truncation", "max_length", "return_tensors", "return_dict",
                               "return_assistant_tokens_mask", "tokenizer_kwargs"})


@functools.lru_cache(maxsize=64)
def template_variables(source: str) -> frozenset[str] | None:
    """The variables a Jinja chat template reads from outside (the names ``chat_template_kwargs``
    may set); None for a template this parser cannot read (any name is then admitted)."""
    import jinja2.ext
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        env = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
        return frozenset(meta.find_undeclared_variables(env.parse(source)))
    except TemplateError:
        return None


class ModelRuntime:
    """``media``: the media rules of a model that takes images and audio (Qwen2.5-Omni), else None."""

    def __init__(self, served: ServedModel, media_limits: MediaLimits | None = None,
                 special_tokens_in_content: bool = False):
        """``special_tokens_in_content``: read control tokens typed in a client's chat strings as the
        tokens they spell (``--allow-special-tokens-in-content``); by default they are plain text
        (gateway/control_tokens.py)."""
        self.name = served.name
        self.path = served.path
        self.stages = tuple(served.stages)
        self.reasoning_parser = served.reasoning_parser
        self.tool_call_parser = served.tool_call_parser
        self.structured_outputs_in_reasoning = served.structured_outputs_in_reasoning
        self.scheduling_policy = served.scheduling_policy
        self.default_chat_template_kwargs = dict(served.default_chat_template_kwargs)
        self.tokenizer = AutoTokenizer.from_pretrained(served.path)
        self.content_tokens = None if special_tokens_in_content else ContentTokens(self.tokenizer)
        config = json.loads((Path(served.path) / "config.json").read_text())
        kind = model_kind(served.path)
        self.speech = SpeechFacts.read(served.path)   # voices, codes per second: read once (speech_facts.py)
        self.media = None
        if kind.is_omni:   # the thinker's LM sets the limits
            limits = media_limits or MediaLimits(allowed_local_dir=served.allowed_local_media_path)
            self.media = MediaProcessor(served.path, limits)
            config = config["thinker_config"]["text_config"]
        elif kind is ModelKind.QWEN3_TTS:   # speech only: the text vocabulary, the talker's context
            talker = config["talker_config"]
            config = {"vocab_size": talker["text_vocab_size"],
                      "max_position_embeddings": talker.get("max_position_embeddings", 2048)}
        self.vocab_size = int(config["vocab_size"])
        # The ids the workers stop on (generation_config.json's win, as the workers read them): the
        # text leaves them out unless include_stop_str_in_output (gateway/output_options.py).
        eos = config.get("eos_token_id")
        if (Path(served.path) / "generation_config.json").exists():
            eos = json.loads((Path(served.path) / "generation_config.json").read_text()).get("eos_token_id", eos)
        self.eos_token_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        model_max = int(config.get("max_position_embeddings", 2048))
        self.max_model_len = min(served.max_model_len or model_max, model_max)
        # No token covers more characters than the vocabulary's longest entry (byte-level BPE spells each
        # byte as one character), so a text longer than this cannot fit the context, whatever it says:
        # refused before it is rendered or tokenized (generation.check_size).
        self.max_prompt_chars = self.max_model_len * max(len(token) for token in self.tokenizer.get_vocab())
        self.created = int(Path(served.path).stat().st_mtime)
        # How /v1/embeddings pools this model (omnirelay/pooling_params.py); None: it does not embed
        # (an omni thinker's or a talker's states are not what its pooling would be trained on).
        self.pooler: PoolerConfig | None = None
        if not kind.is_omni and kind is not ModelKind.QWEN3_TTS:
            self.pooler = resolve_pooler_config(served.path, served.pooler_config or "")
        # A decoder-only reranker's (no, yes) token ids (gateway/scoring.py); () for any other model.
        labels = reranker_label_tokens(served.path) if self.pooler is not None else ()
        self.rerank_token_ids = tuple(self.tokenizer.convert_tokens_to_ids(list(labels)))
        if None in self.rerank_token_ids or any(t == self.tokenizer.unk_token_id for t in self.rerank_token_ids):
            raise ValueError(f"{served.path}: classifier_from_token {labels} are not tokens of its vocabulary")
        self._noted: set[tuple[str, str]] = set()   # (what, name) already logged by _note_unused

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    template: TemplateOptions = TemplateOptions()) -> str:
        """The prompt text of ``messages`` under the model's chat template (or the request's own,
        ``template.chat_template``, which the route admitted), with the server's default template
        variables overridden by the request's. ``tools``: OpenAI function tools, rendered by the
        template. A variable that names an argument of the rendering itself is a 400 naming it; a
        template that refuses the messages too. A variable the template does not read, and a message
        role other than OpenAI's (:data:`STANDARD_ROLES`), go to the template as vLLM passes them (Jinja
        ignores what it does not read; the template decides what a role means): the log says so once
        per name (:meth:`_note_unused`)."""
        variables = self.chat_variables(template, tools)
        reserved = sorted(set(variables) & _RENDER_ARGUMENTS)
        if reserved:
            raise BadRequest(f"chat_template_kwargs.{reserved[0]} is an argument of the rendering itself, not a "
                             "template variable (use the request's own field)", param=f"chat_template_kwargs.{reserved[0]}")
        source = template.chat_template or self._template_source(tools)
        names = template_variables(source) if source else None
        if names is not None:   # vLLM hands them to Jinja, which ignores them: clients send enable_thinking to all
            self._note_unused("chat_template_kwargs", (k for k in template.kwargs if k not in names),
                              "is not read by the chat template: passed through unused (as vLLM does)")
        self._note_unused("message role", (m["role"] for m in messages if m["role"] not in STANDARD_ROLES),
                          "is not one of OpenAI's: passed to the chat template as it is (as vLLM does)")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=template.add_generation_prompt,
                continue_final_message=template.continue_final_message, chat_template=template.chat_template,
                tokenize=False, **variables)
        except (ValueError, TemplateError) as exc:   # the template (or transformers) refused these messages
            param = "chat_template" if template.chat_template else "messages"
            raise BadRequest(f"the chat template cannot render these messages: {exc}"[:500], param=param) from None

    def _note_unused(self, what: str, names, why: str) -> None:
        """Log, once per model and name, what a request passed that the server does not check: the
        rule "never a 200 that silently ignored a field" gives way here to vLLM's clients (they send
        ``enable_thinking`` to every model, and roles of their own), so the server's log keeps the record."""
        for name in names:
            if (what, name) not in self._noted:
                self._noted.add((what, name))
                log.warning("model %s: %s %r %s", self.name, what, name, why)

    def chat_variables(self, template: TemplateOptions = TemplateOptions(), tools: list[dict] | None = None) -> dict:
        """The variables the chat template is rendered with: the server's defaults, then what other
        request fields imply (``template.implied``: only those the template reads, as vLLM filters
        them), then the request's ``chat_template_kwargs``."""
        implied = {}
        if template.implied:
            source = template.chat_template or self._template_source(tools)
            names = template_variables(source) if source else None
            implied = {k: v for k, v in template.implied.items() if names is not None and k in names}
        return {**self.default_chat_template_kwargs, **implied, **template.kwargs}

    def _template_source(self, tools: list[dict] | None) -> str | None:
        try:
            return self.tokenizer.get_chat_template(tools=tools)
        except ValueError:   # no template at all: apply_chat_template says so
            return None

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    template: TemplateOptions = TemplateOptions()) -> list[int]:
        return self.encode_chat_prompt(messages, tools, template)[0]

    def encode_chat_prompt(self, messages: list[dict], tools: list[dict] | None = None,
                           template: TemplateOptions = TemplateOptions()) -> tuple[list[int], str]:
        """The chat's prompt ids and text: rendered (:meth:`render_chat`), refused past
        ``max_prompt_chars`` before it is tokenized, then tokenized with the control tokens a client
        typed read as plain text unless the server allows them (gateway/control_tokens.py)."""
        marked = False
        if self.content_tokens is not None:
            marked_messages, in_messages = self.content_tokens.mark(messages)
            marked_tools, in_tools = self.content_tokens.mark(tools)
            marked = in_messages or in_tools
        text = self.render_chat(marked_messages, marked_tools, template) if marked else \
            self.render_chat(messages, tools, template)
        if len(text) > self.max_prompt_chars:   # the tools, the template's own text: still not tokenized
            raise BadRequest(f"the chat renders to {len(text)} characters; no text over {self.max_prompt_chars} "
                             "fits this model's context", param="messages")
        if marked:
            return self.content_tokens.encode_marked(text, template.add_special_tokens), strip_marks(text)
        return self.encode_text(text, template.add_special_tokens), text

    def encode_client_text(self, text: str) -> list[int]:
        """A client's text with no template around it, its typed control tokens plain text as in a
        chat's messages (unless the server allows them)."""
        ids = self.content_tokens.encode_client_text(text) if self.content_tokens is not None else None
        return ids if ids is not None else self.encode_text(text)

    def encode_text(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    # A LoRA adapter served under its own name (gateway/lora.py) sets these; a base model has none.
    lora = ""
    lora_path = ""

    @property
    def base_name(self) -> str:
        """The name its workers serve (``Submit.model``): its own, or an adapter's base's."""
        return self.name

    def card(self) -> dict:
        card = {"id": self.name, "object": "model", "created": self.created, "owned_by": "omnirelay",
                "root": self.path, "max_model_len": self.max_model_len}
        if self.pooler is not None:   # one instance answers chat and embeddings (vLLM needs two)
            pooler = self.pooler
            card["tasks"] = ["generate", "embed", "score"]
            card["pooler"] = {"pooling_type": pooler.pooling_type.upper(), "normalize": pooler.normalize,
                              "source": pooler.source, "embedding_dimensions": pooler.hidden_size,
                              "matryoshka_dimensions": None if pooler.matryoshka is None
                              else list(pooler.matryoshka) or "any"}
        return card


M = TypeVar("M")


def served_model(models: dict, name: str, kind: type[M], wrong_kind: str) -> M:
    """The served model ``name`` (the app's model table), which must be a ``kind``: 404 if none is
    served by that name, 422 saying ``wrong_kind`` if it is another kind."""
    model = models.get(name)
    if model is None:
        raise NotFound(f"model {name!r} does not exist; see GET /v1/models", param="model")
    if not isinstance(model, kind):
        raise Unprocessable(wrong_kind, param="model")
    return model


def text_model(models: dict, name: str) -> ModelRuntime:
    """The served text model ``name``: 404 if none, 422 for an image or video pipeline."""
    return served_model(models, name, ModelRuntime,
                        f"model {name!r} generates images; use POST /v1/images/generations")
