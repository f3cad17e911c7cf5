"""Quantized weights (workers/llm/quantization.py): which checkpoints are served and how, the int8
linear against its dequantized reference, the dequantized formats against transformers' own
decompression, TP2 of a quantized model against TP1, and what is refused by name.

The quantized checkpoints are written by compressed-tensors itself (``omni-make-model quantize``,
llm-compressor's format) from the tiny float model.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from omnirelay.deploy.builders.quantized import build_quantized
from omnirelay.workers.llm import quantization
from omnirelay.workers.llm.decode import DecodeEngine
from omnirelay.workers.llm.models.llama import LlamaConfig, LlamaModel
from omnirelay.workers.llm.parallel import GroupConfig, GroupRunner
from omnirelay.workers.llm.prefill import PrefillEngine
from omnirelay.workers.llm.quantization import Int8Linear, QuantizedCheckpointError
from omnirelay.workers.role_table import check_config
from omnirelay.workers.runtime.config import WorkerConfig

from engine_support import QUESTIONS, chat_ids, connector, decode_engine, run_decode, run_prefill, runner_for, tok  # noqa: F401

pytestmark = pytest.mark.timeout(300)

INT8_SKIP = pytest.mark.skipif(not quantization.int8_available(torch.device("cpu")),
                               reason="this torch build has no fbgemm int8 GEMM")


@pytest.fixture(scope="module")
def quantized(tiny_model, tmp_path_factory):
    """``quantized(scheme)``: the tiny model written in that compressed-tensors scheme (built once)."""
    root = tmp_path_factory.mktemp("quantized")
    built: dict[str, str] = {}

    def get(scheme: str) -> str:
        if scheme not in built:
            built[scheme] = str(build_quantized(tiny_model, root / scheme, scheme=scheme))
        return built[scheme]

    return get


def _logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    logits, _ = model.prefill(ids)
    return logits.float()


# ----------------------------------------------------------------------------- detection


@pytest.mark.parametrize("scheme,mode,bits", [("W8A8", "int8", 8), ("W8A16", "dequantize", 8),
                                              ("W4A16", "dequantize", 4), ("FP8_DYNAMIC", "dequantize", 8)])
def test_each_compressed_tensors_scheme_is_detected(quantized, scheme, mode, bits):
    path = pathlib.Path(quantized(scheme))
    stored = LlamaConfig.from_dir(path).weight_quant
    assert stored is not None and stored.num_bits == bits
    resolved = quantization.resolve(path, stored, None, torch.device("cpu"))
    expected = mode if quantization.int8_available(torch.device("cpu")) else "dequantize"
    assert resolved is not None and resolved.mode == expected and not resolved.online
    assert quantization.resolve(path, stored, None, torch.device("cuda")).mode == "dequantize"   # no int8 kernel there


def _with_quant_config(tiny_model, tmp_path, quant: dict, nest: str = "") -> str:
    out = tmp_path / "q"
    shutil.copytree(tiny_model, out)
    raw = json.loads((out / "config.json").read_text())
    if nest:
        raw[nest] = {**raw.get(nest, {}), "quantization_config": quant}
    else:
        raw["quantization_config"] = quant
    (out / "config.json").write_text(json.dumps(raw))
    return str(out)


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes", "fp8", "gguf"])
def test_other_methods_are_refused_by_name_at_start_up(tiny_model, tmp_path, method):
    path = _with_quant_config(tiny_model, tmp_path, {"quant_method": method, "bits": 4})
    with pytest.raises(QuantizedCheckpointError, match=f"quant_method '{method}' is not served"):
        LlamaConfig.from_dir(pathlib.Path(path))
    for role in ("prefill", "decode"):   # the worker's start-up checks, before any weight loads
        with pytest.raises(QuantizedCheckpointError, match=f"'{method}'"):
            check_config(WorkerConfig(role=role, model_path=path, model_name="q"))


def test_a_nested_text_config_is_read_too(tiny_model, tmp_path):
    path = _with_quant_config(tiny_model, tmp_path, {"quant_method": "awq"}, nest="text_config")
    with pytest.raises(QuantizedCheckpointError, match="'awq'"):
        LlamaConfig.from_dir(pathlib.Path(path))


@pytest.mark.parametrize("change,named", [
    ({"symmetric": False}, "asymmetric"),
    ({"num_bits": 4}, "int4"),                 # int4 in the int-quantized format
    ({"actorder": "group"}, "activation-ordered"),
])
def test_unserved_variants_of_compressed_tensors_are_refused(quantized, tmp_path, change, named):
    path = pathlib.Path(quantized("W8A8"))
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"]["config_groups"]["group_0"]["weights"].update(change)
    with pytest.raises(QuantizedCheckpointError, match=named):
        quantization.checkpoint_quantization(path, raw)


def test_a_quantized_kv_cache_is_refused(quantized):
    path = pathlib.Path(quantized("W8A8"))
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float"}
    with pytest.raises(QuantizedCheckpointError, match="kv_cache_scheme"):
        quantization.checkpoint_quantization(path, raw)


def test_the_quantization_flag_is_checked_against_the_checkpoint(tiny_model, quantized):
    cpu = torch.device("cpu")
    w8a8 = pathlib.Path(quantized("W8A8"))
    stored = LlamaConfig.from_dir(w8a8).weight_quant
    with pytest.raises(QuantizedCheckpointError, match="already quantized"):
        quantization.resolve(w8a8, stored, "int8", cpu)
    assert quantization.resolve(w8a8, stored, "compressed-tensors", cpu).checkpoint == stored
    with pytest.raises(QuantizedCheckpointError, match="not a quantized checkpoint"):
        quantization.resolve(tiny_model, None, "compressed-tensors", cpu)
    for name in ("fp8", "gptq", "awq"):
        with pytest.raises(QuantizedCheckpointError, match=f"--quantization {name}: not served"):
            WorkerConfig(role="decode", model_path=tiny_model, model_name="q", quantization=name)
    with pytest.raises(QuantizedCheckpointError, match="unknown"):
        WorkerConfig(role="decode", model_path=tiny_model, model_name="q", quantization="int3")
    with pytest.raises(ValueError, match="only prefill and decode"):
        WorkerConfig(role="generate", model_path=tiny_model, model_name="q", quantization="int8")
    with pytest.raises(QuantizedCheckpointError, match="already quantized"):   # omni-worker's start-up check
        check_config(WorkerConfig(role="decode", model_path=str(w8a8), model_name="q", quantization="int8"))


def test_omni_worker_exits_2_naming_the_method(tiny_model, tmp_path):
    path = _with_quant_config(tiny_model, tmp_path, {"quant_method": "gptq", "bits": 4})
    done = subprocess.run([sys.executable, "-m", "omnirelay.workers.daemon", "--role", "decode", "--model", path,
                           "--broker", "ipc:///nonexistent"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "quant_method 'gptq'" in done.stderr


# ----------------------------------------------------------------------------- kernels and values


@INT8_SKIP
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "mapped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int8_linear_equals_its_dequantized_reference(dtype, rows, packed):
    """Both kernels compute exactly sum(q_x * q_w) * scale_x * scale_w in int32 / float32: against
    the same product in float64 from the dequantized values, within float32 rounding (and bf16
    output rounding). Rows of very different magnitude check the activation scale is per token;
    two parts (as q/k/v are) check the parts sit side by side."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 160, generator=gen) * 0.05
    q, scale = quantization.quantize_per_channel(weight)
    bias = torch.randn(96, generator=gen)
    x = (torch.randn(rows, 160, generator=gen) * torch.logspace(-2, 2, rows)[:, None]).to(dtype)
    got = Int8Linear([(q[:64], scale[:64]), (q[64:], scale[64:])], bias, packed=packed)(x)
    assert got.dtype == dtype and got.shape == (rows, 96)
    xf = x.double()
    token_scale = xf.abs().amax(dim=1, keepdim=True) / 127
    reference = torch.round(xf / token_scale) * token_scale @ (q.double() * scale.double()[:, None]).T + bias.double()
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3
    assert torch.allclose(got.double(), reference, rtol=tolerance, atol=tolerance * reference.abs().max().item())


def test_per_channel_quantization_round_trips_within_half_a_step():
    weight = torch.randn(32, 48) * torch.logspace(-3, 1, 32)[:, None]
    q, scale = quantization.quantize_per_channel(weight)
    assert q.dtype == torch.int8
    # the largest magnitude sits at 127.5 steps and clamps to 127: half a step, as everywhere else
    assert ((q.float() * scale[:, None] - weight).abs() <= scale[:, None] * (0.5 + 1e-4)).all()


def test_unpacking_matches_compressed_tensors():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    for bits in (4, 8):
        values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (6, 40), dtype=torch.int8)
        packed = pack_to_int32(values, bits)
        assert torch.equal(quantization.unpack_int32(packed, bits, 40), values)


@pytest.mark.parametrize("scheme", ["W8A16", "W4A16"])
def test_dequantized_checkpoints_equal_transformers_decompression(quantized, tok, scheme):
    """transformers (with compressed-tensors installed) decompresses these checkpoints to float
    weights on load: the engine's dequantization gives the same logits."""
    from transformers import AutoModelForCausalLM
    path = quantized(scheme)
    ids = chat_ids(tok, QUESTIONS[1])
    ours = _logits(LlamaModel(path, torch.float32), ids)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0, -1].float()
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


@INT8_SKIP
def test_w8a8_checkpoint_and_online_int8_serve_the_same_weights(tiny_model, quantized, tok):
    """llm-compressor's W8A8 preset and --quantization int8 round the same float weights the same
    way: the two models' linears hold equal int8 values and scales, so their logits agree; both stay
    close to the float model (greedy first token equal on the tiny model's prompts)."""
    checkpoint = LlamaModel(quantized("W8A8"), torch.float32)
    online = LlamaModel(tiny_model, torch.float32, quantization="int8")
    plain = LlamaModel(tiny_model, torch.float32)
    assert isinstance(checkpoint.layers[0].qkv, Int8Linear) and isinstance(online.layers[0].down, Int8Linear)
    agree = 0
    for question in QUESTIONS:
        ids = chat_ids(tok, question)
        a, b, ref = _logits(checkpoint, ids), _logits(online, ids), _logits(plain, ids)
        assert torch.allclose(a, b, atol=2e-3 * ref.abs().max().item()), (a - b).abs().max()
        agree += int(a.argmax() == ref.argmax())
    assert agree >= len(QUESTIONS) - 1


@INT8_SKIP
def test_mapped_int8_weights_are_the_checkpoints_pages(quantized, tok):
    """The prefill role's choice (``kernels="mapped"``): a W8A8 checkpoint's int8 weights are used in
    place, pages of the file's memory map (no private copy), and compute what the packed ones do:
    each linear exactly (test_int8_linear_equals_its_dequantized_reference); through the model an
    activation that lands on a rounding boundary in one may round the other way in the other, so
    the logits agree to about 1 % and the greedy token is the same."""
    path = pathlib.Path(quantized("W8A8")).resolve()
    mapped_model = LlamaModel(path, torch.float32, kernels="mapped")
    spans = [tuple(int(x, 16) for x in line.split()[0].split("-"))
             for line in pathlib.Path("/proc/self/maps").read_text().splitlines()
             if line.split()[-1] == str(path / "model.safetensors")]
    assert spans, "the checkpoint is not memory-mapped"
    for layer in mapped_model.layers:
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert isinstance(linear, Int8Linear) and not linear.packed
            for part in linear.parts:
                assert any(lo <= part.data_ptr() and part.data_ptr() + part.nbytes <= hi for lo, hi in spans)
    packed_model = LlamaModel(path, torch.float32)
    for question in QUESTIONS[:3]:
        ids = chat_ids(tok, question)
        a, b = _logits(mapped_model, ids), _logits(packed_model, ids)
        assert torch.allclose(a, b, atol=3e-2 * b.abs().max().item()), (a - b).abs().max()
        assert a.argmax() == b.argmax()


@INT8_SKIP
def test_tp2_of_a_quantized_model_equals_tp1(quantized, connector, tok):  # noqa: F811
    """Each rank reads its slice of the int8 weights and their scales; the greedy tokens of a TP=2
    group equal one process's. Row-parallel ranks quantize their own slice of each activation row,
    so the logits differ by rounding, not the tokens on the tiny model."""
    path = quantized("W8A8")
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:3]]
    single = LlamaModel(path, torch.float32)
    prefilled = run_prefill(PrefillEngine(runner_for(single), connector, max_model_len=2048, max_batched_tokens=64),
                            prompts)
    expected = run_decode(decode_engine(single, connector, num_blocks=128), prompts, prefilled)
    runner = GroupRunner(GroupConfig(path, tp_size=2, block_size=16, num_blocks=128))
    try:
        prefilled = run_prefill(PrefillEngine(runner, connector, max_model_len=2048, max_batched_tokens=64), prompts)
        engine = DecodeEngine(runner, connector, max_num_seqs=16, max_model_len=2048, transfer_timeout_s=5)
        got = run_decode(engine, prompts, prefilled)
    finally:
        runner.close()
    assert got == expected


@INT8_SKIP
def test_a_quantized_mixture_of_experts(tmp_path, tok):
    """Qwen3-MoE: compressed-tensors quantizes the Linear modules (attention; the router gate is read
    dequantized); transformers keeps the experts as fused parameters, which stay float in the file and
    in the engine. The W8A8 checkpoint computes what --quantization int8 does on the float one."""
    from omnirelay.deploy.builders.qwen3 import build_tiny_qwen3
    moe = build_tiny_qwen3(tmp_path / "moe", moe=True)
    w8a8 = build_quantized(moe, tmp_path / "moe-w8a8", scheme="W8A8")
    checkpoint, online = LlamaModel(w8a8, torch.float32), LlamaModel(moe, torch.float32, quantization="int8")
    plain = LlamaModel(moe, torch.float32)
    assert isinstance(checkpoint.layers[0].qkv, Int8Linear) and checkpoint.layers[0].moe is not None
    ids = list(range(5, 40))
    a, b, ref = _logits(checkpoint, ids), _logits(online, ids), _logits(plain, ids)
    assert torch.allclose(a, b, atol=2e-3 * ref.abs().max().item()), (a - b).abs().max()
    assert a.argmax() == ref.argmax()
