"""Tiny random-weight Qwen3 and Qwen3-MoE causal LMs (``omni-make-model tiny-qwen3 | tiny-qwen3-moe``).

Same recipe as ``tiny-llm`` (:mod:`.llm`: its tokenizer, per-module init scales and atomic
build), on the Qwen3 architectures, with Qwen3's own chat template (:data:`QWEN3_CHAT_TEMPLATE`:
its ``enable_thinking`` switch, earlier turns' reasoning dropped):

* ``tiny-qwen3`` -- ``Qwen3ForCausalLM``: 4 layers, hidden 256, 4 query / 2 KV heads with an explicit
  ``head_dim`` of 32 (so q is 128 wide, not hidden / heads), per-head ``q_norm`` / ``k_norm``.
* ``tiny-qwen3-moe`` -- ``Qwen3MoeForCausalLM``: the same attention; 8 experts (top 2,
  ``norm_topk_prob``, ``moe_intermediate_size`` 128) in layers 0, 1 and 3; layer 2 is listed in
  ``mlp_only_layers`` and keeps a dense MLP, so both kinds of layer are exercised.

The q/k norm weights are drawn around 1 (not left at ones) so a re-implementation that drops them
is caught, and the router's scale gives clear top-k margins: greedy parity with transformers then
tests the routing instead of float32 coin flips. Saved in the hub's layout (one
``experts.<e>.{gate,up,down}_proj`` per expert), as the real checkpoints are.
"""

from __future__ import annotations

import os
import pathlib

from omnirelay.deploy.builders.llm import (INIT_STD, SPECIAL_TOKENS, _build_tokenizer, _patch_json, build_atomically,
                                          cached_model, is_complete)

KINDS = ("tiny-qwen3", "tiny-qwen3-moe")
RECIPE_VERSION = 2     # 2: Qwen3's chat template (thinking switch, reasoning of earlier turns)
NUM_EXPERTS = 8
ROUTER_STD = 0.1       # router logits of std ~1.6 over 8 experts: decisive but not one-hot
NORM_STD = 0.1         # q_norm / k_norm weights ~ 1 ± 0.1


# Qwen3's chat template, written from its documented behaviour:
# * ChatML turns; with ``tools`` a first system block lists them and asks for <tool_call> JSON (Hermes
#   style), an assistant's ``tool_calls`` render as <tool_call> blocks after its text, consecutive
#   ``tool`` messages as one user turn of <tool_response> blocks;
# * an assistant turn's reasoning (its ``reasoning_content``, or a <think>…</think> block at the start
#   of its content) is kept only for turns after the last user message (a tool-calling loop still in
#   progress); earlier turns show the answer alone, so old reasoning never re-enters the prompt;
# * the generation prompt opens the assistant turn; ``enable_thinking=false`` appends an empty
#   ``<think>\n\n</think>\n\n`` block there, so the model answers at once.
QWEN3_CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set state = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set state.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set text = message.content if message.content is string else '' %}"
    "{%- set thought = message.reasoning_content if message.reasoning_content is string else '' %}"
    "{%- if message.role == 'system' and tools and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if '</think>' in text %}"
    "{%- if not thought %}{%- set thought = text.split('</think>')[0].split('<think>')[-1] %}{%- endif %}"
    "{%- set text = text.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > state.last_user and thought %}"
    "{{ '<think>\\n' + thought.strip('\\n') + '\\n</think>\\n\\n' }}"
    "{%- endif %}{{ text }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- if text or not loop.first %}{{ '\\n' }}{%- endif %}"
    "{{ '<tool_call>\\n{\\\"name\\\": \\\"' + call.function.name + '\\\", \\\"arguments\\\": ' }}"
    "{{ call.function.arguments | tojson }}{{ '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + text + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{ '<|im_start|>' + message.role + '\\n' + text + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def _build_into(out_dir: pathlib.Path, seed: int, moe: bool, num_experts: int) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = _build_tokenizer(out_dir)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    common = dict(vocab_size=-(-len(tok) // 64) * 64, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, rope_theta=10000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=ids["<|endoftext|>"],
                  eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], use_cache=True)
    if moe:
        config = Qwen3MoeConfig(**common, intermediate_size=256, moe_intermediate_size=128, num_experts=num_experts,
                                num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2])
        model_cls, arch = Qwen3MoeForCausalLM, "Qwen3MoeForCausalLM"
    else:
        config = Qwen3Config(**common, intermediate_size=512)
        model_cls, arch = Qwen3ForCausalLM, "Qwen3ForCausalLM"
    config.architectures = [arch]
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()
        gen = torch.Generator().manual_seed(seed)   # weights: a pure function of the seed (see llm)
        for name, param in model.named_parameters():
            module, kind = name.split(".")[-2:]
            if module in INIT_STD and kind == "weight":
                param.normal_(0.0, INIT_STD[module], generator=gen)
            elif module in ("q_norm", "k_norm"):
                param.normal_(1.0, NORM_STD, generator=gen)
            elif module == "gate" and kind == "weight":          # the MoE router
                param.normal_(0.0, ROUTER_STD, generator=gen)
            elif module == "experts":                            # fused [E, 2I, H] / [E, H, I] in transformers 5
                param.normal_(0.0, INIT_STD["gate_proj" if kind == "gate_up_proj" else "down_proj"], generator=gen)
        model.lm_head.weight[len(tok):].zero_()
        model.model.embed_tokens.weight[len(tok):].zero_()
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"], eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"], do_sample=False)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    extra = {"num_experts": num_experts} if moe else {}
    _patch_json(out_dir / "config.json", torch_dtype="float32", dtype="float32", rope_theta=10000.0, **extra)
    _patch_json(out_dir / "tokenizer_config.json", drop=("extra_special_tokens",),
                chat_template=QWEN3_CHAT_TEMPLATE, tokenizer_class="PreTrainedTokenizerFast",
                additional_special_tokens=["<|im_start|>"])
    # transformers reads chat_template.jinja before tokenizer_config.json's field: both say the same.
    (out_dir / "chat_template.jinja").write_text(QWEN3_CHAT_TEMPLATE)
    os.chmod(out_dir, 0o755)
    for f in out_dir.iterdir():
        os.chmod(f, 0o644)


def build_tiny_qwen3(path: str | os.PathLike, seed: int = 0, *, moe: bool = False, num_experts: int = NUM_EXPERTS,
                     force: bool = False) -> pathlib.Path:
    """Write ``tiny-qwen3`` (or, with ``moe``, ``tiny-qwen3-moe`` of ``num_experts`` experts) to ``path``."""
    return build_atomically(path, lambda tmp: _build_into(tmp, seed, moe, num_experts), force=force,
                            complete=is_complete, what="model")


def cached_qwen3(moe: bool = False, num_experts: int = NUM_EXPERTS) -> pathlib.Path:
    """The cached seed-0 build (made on first use; safe under concurrent builders)."""
    name = f"{KINDS[moe]}-v{RECIPE_VERSION}-seed0" + (f"-e{num_experts}" if moe else "")
    return cached_model(name, lambda tmp: _build_into(tmp, 0, moe, num_experts), is_complete)
