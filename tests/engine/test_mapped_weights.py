"""The prefill role's weights stay pages of the checkpoint's memory map (``kernels="mapped"``).

A prefill and a decode worker of one host serve the same directory; the decode worker packs its
weights for oneDNN (a private copy: decode is bound by reading them), the prefill worker runs
``F.linear`` on the safetensors memory map in place, so the host holds one private copy, not two.
Checked here: every linear weight of a mapped model lies inside the file's mapping in this process
(not a copy), and a mapped model computes what the fused model computes.
"""

from __future__ import annotations

import pathlib

import torch

from omnirelay.workers.kv.cache import PagedKVCache
from omnirelay.workers.llm.forward_batch import ForwardBatch
from omnirelay.workers.llm.models.llama import LlamaModel


def _file_mappings(path: pathlib.Path) -> list[tuple[int, int]]:
    spans = []
    for line in pathlib.Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end))
    return spans


def test_mapped_weights_are_the_checkpoints_pages(tiny_model):
    model = LlamaModel(tiny_model, kernels="mapped")
    spans = _file_mappings(pathlib.Path(tiny_model).resolve() / "model.safetensors")
    assert spans, "the checkpoint is not memory-mapped"

    def mapped(t: torch.Tensor) -> bool:
        return any(start <= t.data_ptr() and t.data_ptr() + t.nbytes <= end for start, end in spans)

    for layer in model.layers:
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down):
            assert not linear.packed
            for part in linear.parts or [linear.weight]:
                assert mapped(part), "a linear weight was copied out of the memory map"
    assert mapped(model.embed)
    # The fused model concatenates q/k/v and gate/up: private copies.
    fused = LlamaModel(tiny_model, kernels="torch")
    assert not mapped(fused.layers[0].qkv.weight)


def test_mapped_model_computes_what_the_fused_one_does(tiny_model):
    torch.set_num_threads(1)
    mapped, fused = LlamaModel(tiny_model, kernels="mapped"), LlamaModel(tiny_model, kernels="torch")
    cfg = mapped.config
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (7, 30, 19)]
    logits = []
    for model in (mapped, fused):
        cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks=16)
        blocks = [cache.allocator.allocate(cache.blocks_needed(len(p))) for p in prompts]
        logits.append(model.forward(ForwardBatch.build([(p, 0, b) for p, b in zip(prompts, blocks)],
                                                       cache.block_size), cache))
    assert torch.allclose(logits[0], logits[1], atol=1e-4, rtol=1e-5)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


def test_each_role_gets_its_kernels():
    from omnirelay.workers.llm.role_builders import role_kernels
    assert role_kernels("prefill", "bfloat16", "cpu") == "mapped"
    assert role_kernels("decode", "bfloat16", "cpu") == "auto"
    assert role_kernels("prefill", "float32", "cpu") == "auto"    # packing still pays at prefill sizes
    assert role_kernels("prefill", "bfloat16", "cuda:0") == "auto"
