"""Build a tiny random-weight Qwen2 causal LM for tests, demos and CI (``omni-make-model``).

Usage::

    omni-make-model tiny-llm DIR [--seed N] [--force]
    omni-make-model tiny-sd DIR [--seed N] [--force]     # diffusers text-to-image (stable_diffusion.py)
    omni-make-model tiny-omni DIR [--seed N] [--force]   # Qwen2.5-Omni (omni.py)
    omni-make-model tiny-qwen3-omni DIR [--seed N] [--force]   # Qwen3-Omni (qwen3_omni.py)
    omni-make-model tiny-video DIR [--seed N] [--force]  # diffusers text-to-video (video.py)
    omni-make-model tiny-dit DIR [--seed N] [--force]    # diffusers text-to-image, SD3 transformer (dit.py)
    omni-make-model tiny-qwen3 DIR [--seed N] [--force]      # Qwen3 (q/k norm; qwen3.py)
    omni-make-model tiny-qwen3-moe DIR [--seed N] [--force]  # Qwen3-MoE, 8 experts top 2 (qwen3.py)
    omni-make-model tiny-qwen3-embedding DIR [--seed N] [--force]  # Qwen3-Embedding-style (qwen3_embedding.py)
    omni-make-model tiny-zimage DIR [--seed N] [--force] # Z-Image (ZImagePipeline, zimage.py)
    omni-make-model tiny-qwen3-tts DIR [--seed N] [--force]   # Qwen3-TTS 12 Hz CustomVoice (qwen3_tts.py)
    omni-make-model tiny-wan DIR [--seed N] [--force]    # Wan 2.2 text-to-video (WanPipeline, wan.py)
    omni-make-model tiny-lora BASE_DIR DIR [--rank R --targets q_proj,v_proj --seed N]   # PEFT adapter (lora.py)
    omni-make-model quantize SRC DIR [--scheme W8A8|W8A16|W4A16|FP8_DYNAMIC]   # compressed-tensors (quantized.py)

The result is an ordinary Hugging Face model directory, loadable offline with
``AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)``:

* ``config.json`` / ``generation_config.json`` -- a 4-layer, 256-wide Qwen2 (GQA, 4 query / 2 KV
  heads), float32, untied embeddings; generation stops on ``<|im_end|>`` or ``<|endoftext|>``.
* ``model.safetensors`` -- random weights, a pure function of ``--seed``.
* ``tokenizer.json`` / ``tokenizer_config.json`` -- a byte-level BPE trained here on the small
  corpus below, with the ChatML special tokens and chat template that Qwen uses.

Why it exists: the serving stack must be exercised end to end (tokenize, chat template, prefill,
decode, stop tokens) on machines with no network and no real weights. The weights are random but
scaled per module (see INIT_STD) so that greedy decoding walks through many different tokens with
clear margins between logits; an exact-match check between our own forward pass and transformers'
then actually tests something instead of comparing one repeated token or float32 coin-flip ties.

Everything is built in a temporary sibling directory and renamed into place, so readers never see
a half-written model, and concurrent builders of the shared cache can race safely.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import pathlib
import shutil
import sys
import tempfile

from omnirelay.paths import cache_root

MODEL_KIND = "tiny-llm"
# Bump when the recipe changes so stale cached builds are not reused.
RECIPE_VERSION = 2   # 2: the chat template renders tools, tool calls and tool messages
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json")
# Same pre-tokenization split as Qwen2's tokenizer, so loading our files through Qwen2Tokenizer
# (which rebuilds the pipeline from the vocab) or through the generic backend tokenizes alike.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# ChatML as Qwen2.5 writes it. With ``tools`` a system block lists them (Hermes style) and says how
# to call them; an assistant message's ``tool_calls`` render as <tool_call> JSON after its content,
# a ``tool`` message as a user turn holding a <tool_response>. Without tools the text is plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '"
    " '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": '"
    " '<args-json-object>}\\n</tool_call><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{ call['function']['arguments'] | tojson }}{{ '}\\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>' + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Per-module init std, keyed by the parameter's module name. HF's uniform 0.02 leaves a 256-wide
# random model's residual stream dominated by near-uniform attention averages, so greedy decoding
# repeats one token. One large uniform std instead blows activations up layer after layer and
# float32 rounding then differs by ~1e-3 between two correct implementations, enough to flip an
# argmax. So: unit-scale token embeddings dominate the residual (the next token depends strongly on
# the current one), sub-layers keep roughly unit variance with moderately peaked attention, and
# only lm_head is wide, which spreads the logits without amplifying rounding inside the network.
INIT_STD = {
    "embed_tokens": 1.0,
    "q_proj": 0.1,
    "k_proj": 0.1,
    "v_proj": 0.0625,
    "o_proj": 0.0625,
    "gate_proj": 0.0625,
    "up_proj": 0.0625,
    "down_proj": 0.044,
    "lm_head": 0.25,
}
# Non-zero q/k/v biases so a re-implementation that drops Qwen2's attention biases is caught.
BIAS_STD = 0.2

CORPUS = """\
The harbor town woke slowly. Fishing boats came back before dawn, and the market opened as soon as
the first crates were carried up the stone steps. Children ran between the stalls while their
parents argued about the price of bread, salt, rope and oil. By noon the square was quiet again.

A good recipe is a small program. You gather the ingredients, measure them carefully, and follow
each step in order: heat the pan, melt the butter, add two eggs, stir gently, and season with a
little pepper. If something goes wrong, you taste, adjust, and try once more tomorrow.

Computers store numbers as bits, and every character of text becomes a sequence of bytes. A model
reads those bytes as tokens, predicts the next one, and repeats the process until it reaches a
stop token. Servers batch many requests together so that the hardware stays busy and the answers
arrive quickly, even when thousands of people are asking questions at the same time.

What is the weather like today? It is sunny and warm, with a light wind from the west. Could you
help me write a short letter to my friend? Of course! Tell me what you would like to say, and I
will help you find the right words. Thank you very much; that is very kind of you.

The river runs north through the valley, past old farms, green fields and a small wooden bridge.
In spring the water rises, and in autumn the leaves turn red, orange and gold. Travelers often
stop at the inn near the bridge, where they share stories, music and hot soup late into the night.

Science begins with a question. Why does the moon change its shape? How do birds find their way
south every year? Careful observation, honest measurement and clear reasoning turn curiosity into
knowledge, and knowledge into tools that make life safer, healthier and more interesting for all.

Our library opens at nine on weekdays and at ten on Saturday. Members may borrow up to twelve
books, four films and two board games for three weeks. Please return damaged items to the front
desk instead of the drop box, and ask a librarian if you need a quiet room for studying or meetings.

She packed a map, a compass, a blanket, three apples and a thermos of coffee, then climbed toward
the ridge. Clouds gathered over the peaks, thunder rumbled in the distance, and a cold rain began
to fall. Sheltering beneath a rocky overhang, she watched lightning split the sky above the lake.

Good software is tested often. Engineers write small functions, document their behavior, review
each change with colleagues and measure performance before shipping. When a bug appears, they
reproduce it, fix the cause rather than the symptom, and add a regression check so it never returns.
"""


def _build_tokenizer(out_dir: pathlib.Path):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
        vocab_size=1536,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        # All 256 byte symbols, so any unicode string encodes without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


# Qwen2.5-0.5B's layer geometry (24 layers, hidden 896, 14 heads, 2 KV heads, MLP 4,864, its 151,936-row
# tied embedding; 494 M parameters with the embedding): a model of a size people serve, for benchmarks
# at real shapes (a 4-layer, 256-wide model is overhead-bound and flatters a lean engine).
QWEN25_05B_GEOMETRY = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                           intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                           max_position_embeddings=32768, rope_theta=1000000.0)


def _build_into(out_dir: pathlib.Path, seed: int) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = _build_tokenizer(out_dir)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = -(-len(tok) // 64) * 64
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        use_cache=True,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    # fork_rng: building a model must not reseed the caller's global RNG.
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32).eval()
        # A private generator walking named_parameters() (a fixed order) makes the weights a pure
        # function of the seed, independent of how much RNG transformers' own init consumed.
        gen = torch.Generator().manual_seed(seed)
        for name, param in model.named_parameters():
            module, kind = name.split(".")[-2:]
            if module in INIT_STD and kind == "weight":
                param.normal_(0.0, INIT_STD[module], generator=gen)
            elif kind == "bias":
                param.normal_(0.0, BIAS_STD, generator=gen)
        # Rows past the tokenizer only pad the matrix to a multiple of 64; a zero lm_head row gives
        # logit 0, far below the usual max (~3 std), so greedy never emits an undecodable id.
        model.lm_head.weight[len(tok) :].zero_()
        model.model.embed_tokens.weight[len(tok) :].zero_()
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)
    # transformers 5 writes "dtype" and nests rope_theta; older readers (and our own loaders) look
    # for the flat 4.x keys, so write both spellings.
    _patch_json(out_dir / "config.json", torch_dtype="float32", dtype="float32", rope_theta=10000.0)
    # 5.x keeps the template in chat_template.jinja, names its own backend class and lists extra
    # specials in a form 4.x rejects; 4.x reads the template from the config and only knows
    # PreTrainedTokenizerFast. 5.x accepts all of the 4.x spellings.
    _patch_json(
        out_dir / "tokenizer_config.json",
        drop=("extra_special_tokens",),
        chat_template=CHAT_TEMPLATE,
        tokenizer_class="PreTrainedTokenizerFast",
        additional_special_tokens=["<|im_start|>"],
    )
    # mkdtemp made the dir private and some writers leave 0600 files; a model dir is shared data.
    os.chmod(out_dir, 0o755)
    for f in out_dir.iterdir():
        os.chmod(f, 0o644)


def _patch_json(path: pathlib.Path, drop: tuple[str, ...] = (), **updates) -> None:
    data = json.loads(path.read_text())
    for key in drop:
        data.pop(key, None)
    data.update(updates)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def is_complete(path: str | os.PathLike) -> bool:
    p = pathlib.Path(path)
    return all((p / name).is_file() for name in REQUIRED_FILES)


def _fresh_tmp(target: pathlib.Path) -> pathlib.Path:
    # Same parent as the target so the final rename stays on one filesystem and is atomic.
    target.parent.mkdir(parents=True, exist_ok=True)
    return pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))


def build_atomically(path: str | os.PathLike, write, *, force: bool, complete, what: str) -> pathlib.Path:
    """Run ``write(tmp_dir)`` into a temporary directory beside ``path`` and rename it into place, so
    a crash never leaves a half-written model. An existing non-empty ``path`` raises
    FileExistsError unless ``force``, in which case it is replaced in one rename step."""
    target = pathlib.Path(path).expanduser().absolute()
    occupied = target.exists() and (not target.is_dir() or any(target.iterdir()))
    if occupied and not force:
        state = f"a complete {what}" if complete(target) else "non-empty"
        raise FileExistsError(f"{target} already exists ({state}); use --force to replace it")
    tmp = _fresh_tmp(target)
    try:
        write(tmp)
        if occupied:
            # Move the old one aside first: rename cannot replace a non-empty directory.
            trash = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, trash / "old")
            os.rename(tmp, target)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, target)  # also succeeds onto an empty directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _build_real_shape_into(out_dir: pathlib.Path, seed: int) -> None:
    """Qwen2.5-0.5B's geometry with random weights (transformers' own init, std 0.02) in bfloat16, the
    tiny model's tokenizer and chat template: what the engine benchmarks serve at a real size."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = _build_tokenizer(out_dir)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen2Config(**QWEN25_05B_GEOMETRY, rms_norm_eps=1e-6, bos_token_id=ids["<|endoftext|>"],
                         eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], use_cache=True)
    config.architectures = ["Qwen2ForCausalLM"]
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
        # The tokenizer names only the first few hundred of the 151,936 rows. A greedy pick past it
        # decodes to no text, and a stream holds back text it cannot decode, so an answer of such ids
        # would arrive in one piece at its end; a zero row (tied: embedding and lm_head) gives logit 0,
        # below the best named token's.
        model.model.embed_tokens.weight[len(tok):].zero_()
    model.generation_config = GenerationConfig(bos_token_id=ids["<|endoftext|>"],
                                               eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
                                               pad_token_id=ids["<|endoftext|>"], do_sample=False)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    _patch_json(out_dir / "config.json", torch_dtype="bfloat16", dtype="bfloat16", rope_theta=1000000.0)
    _patch_json(out_dir / "tokenizer_config.json", drop=("extra_special_tokens",), chat_template=CHAT_TEMPLATE,
                tokenizer_class="PreTrainedTokenizerFast", additional_special_tokens=["<|im_start|>"])
    os.chmod(out_dir, 0o755)
    for f in out_dir.iterdir():
        os.chmod(f, 0o644)


def build_real_shape_llm(path: str | os.PathLike, seed: int = 0, *, force: bool = False) -> pathlib.Path:
    """Write the Qwen2.5-0.5B-geometry bf16 model to ``path`` (see :func:`_build_real_shape_into`)."""
    return build_atomically(path, lambda tmp: _build_real_shape_into(tmp, seed), force=force, complete=is_complete,
                            what="model")


def build_tiny_llm(path: str | os.PathLike, seed: int = 0, *, force: bool = False) -> pathlib.Path:
    """Write the tiny model to ``path`` and return it (see :func:`build_atomically`)."""
    return build_atomically(path, lambda tmp: _build_into(tmp, seed), force=force, complete=is_complete,
                            what="model")


def default_model_dir() -> pathlib.Path:
    """Return the cached default tiny model (seed 0), building it on first use."""
    return cached_model(f"{MODEL_KIND}-v{RECIPE_VERSION}-seed0", lambda tmp: _build_into(tmp, 0), is_complete)


def cached_model(name: str, write, complete) -> pathlib.Path:
    """The directory ``name`` in the cache, written by ``write(tmp_dir)`` on first use. Safe when
    several processes race: each builds into its own temporary directory, the first rename wins."""
    target = cache_root() / name
    if complete(target):
        return target
    tmp = _fresh_tmp(target)
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process won the race and its copy is already in place; ours is redundant.
            if not complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# omni-make-model's other kinds: kind -> (module in this package, its builder, the builder's options).
FAMILY_BUILDERS: dict[str, tuple[str, str, dict]] = {
    "tiny-sd": ("stable_diffusion", "build_tiny_text_to_image", {}),
    "tiny-video": ("video", "build_tiny_text_to_video", {}),
    "tiny-omni": ("omni", "build_tiny_omni", {}),
    "tiny-qwen3-omni": ("qwen3_omni", "build_tiny_qwen3_omni", {}),
    "tiny-dit": ("dit", "build_tiny_dit", {}),
    "tiny-qwen3": ("qwen3", "build_tiny_qwen3", {}),
    "tiny-qwen3-moe": ("qwen3", "build_tiny_qwen3", {"moe": True}),
    "tiny-qwen3-embedding": ("qwen3_embedding", "build_tiny_qwen3_embedding", {}),
    "tiny-qwen3-reranker": ("qwen3_embedding", "build_tiny_qwen3_reranker", {}),
    "tiny-zimage": ("zimage", "build_tiny_zimage", {}),
    "tiny-wan": ("wan", "build_tiny_wan", {}),
    "tiny-qwen3-tts": ("qwen3_tts", "build_tiny_qwen3_tts", {}),
    "shape-qwen2.5-0.5b": ("llm", "build_real_shape_llm", {}),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["tiny-lora"]:   # takes a base directory too: its own parser (lora.py)
        from omnirelay.deploy.builders.lora import main as lora_main
        return lora_main(argv[1:])
    if argv[:1] == ["quantize"]:    # a source directory and a scheme: its own parser (quantized.py)
        from omnirelay.deploy.builders.quantized import main as quantize_main
        return quantize_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="omni-make-model", description="Write a tiny random-weight model directory."
    )
    parser.add_argument("kind", choices=[MODEL_KIND, *FAMILY_BUILDERS],
                        help="which model to build (tiny-sd: a diffusers text-to-image pipeline; "
                             "tiny-dit: the same around a diffusion transformer (SD3); "
                             "tiny-qwen3 / tiny-qwen3-moe: random-weight Qwen3 / Qwen3-MoE causal LMs; "
                             "tiny-qwen3-embedding: tiny-qwen3 with sentence-transformers' last-token pooling; "
                             "tiny-zimage: Z-Image (ZImagePipeline, Qwen3 text encoder); "
                             "tiny-wan: Wan 2.2 text-to-video (WanPipeline, two experts, UMT5); "
                             "tiny-video: a diffusers text-to-video pipeline; "
                             "tiny-omni: Qwen2.5-Omni thinker + talker + token2wav; "
                             "tiny-qwen3-omni: Qwen3-Omni MoE thinker + talker + code2wav; "
                             "tiny-qwen3-tts: Qwen3-TTS 12 Hz CustomVoice, needs the qwen_tts package; "
                             "shape-qwen2.5-0.5b: random weights in Qwen2.5-0.5B's geometry, bfloat16, for "
                             "benchmarks at a real size)")
    parser.add_argument("dir", help="output directory (created atomically)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--force", action="store_true", help="replace an existing directory")
    args = parser.parse_args(argv)

    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the one-shard "Writing model shards" bar is just noise
    # Single-threaded init keeps the CLI polite on shared CI boxes; not done at import so library
    # users keep their own threading settings.
    torch.set_num_threads(1)
    if args.kind == MODEL_KIND:
        build = build_tiny_llm
    else:
        # Each family's builder module loads only when asked for: their libraries are heavy.
        module, function, options = FAMILY_BUILDERS[args.kind]
        build = functools.partial(getattr(importlib.import_module(f".{module}", __package__), function), **options)
    try:
        out = build(args.dir, seed=args.seed, force=args.force)
    except FileExistsError as exc:
        print(f"omni-make-model: error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
