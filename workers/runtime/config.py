"""Configuration of one worker daemon: one frozen object, validated on construction, whose fields
also declare ``omni-worker``'s flags (:mod:`omnirelay.config_flags`). What only the chosen engine can
check against the model directory (sequence- and expert-parallel sizes) is checked by the role table
(:func:`omnirelay.workers.role_table.check_config`), so this bottom layer imports no engine."""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid

from omnirelay import lora_modules, speculative
from omnirelay.block_hash import DEFAULT_BLOCK_SIZE
from omnirelay.config_flags import flag, flag_group, no_flag
from omnirelay.lora_modules import LoraOptions
from omnirelay.speculative import SpeculativeConfig

from omnirelay.workers.runtime import dtypes, quantization_methods
from omnirelay.workers.runtime.devices import parse_device_ids

ROLES = ("encode", "prefill", "decode", "generate")


def _unset_if_empty(value):
    """0 or "" on the command line means "not given": the stage's value, else the field's default."""
    return value or None


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """What one worker daemon serves and how. Each field's flag and help text are in its metadata
    (:mod:`omnirelay.config_flags`): ``omni-worker``'s flags are generated from these fields. A flag
    whose parser default is None may be left out: omni-worker then takes the stage YAML's value."""

    role: str = flag("--role", "which stage this worker serves", required=True, choices=ROLES)
    model_path: str = flag("--model", "local model directory (generate: a diffusers pipeline directory)",
                           required=True, parse=os.path.abspath)
    model_name: str = flag("--served-model-name", "the name the model is served under, what requests say in "
                           "'model' (default: --model)", cli_default=None, parse=_unset_if_empty)
    broker: str = flag("--broker", "ZeroMQ endpoint of the broker", default="tcp://127.0.0.1:5555")
    worker_id: str = flag("--worker-id", "unique id on the bus (default: role-host-pid-random)", default="")
    capacity: int = flag("--capacity", "max requests held at once, the credits this worker grants (0: the "
                         "stage's runtime.max_batch_size, else 64 for decode and 8 for the other roles)",
                         default=0, type=int, parse=_unset_if_empty)
    max_model_len: int = flag("--max-model-len", "longest sequence, prompt + output (0: the model's max "
                              "positions)", default=0, type=int)
    kv_cache_bytes: int = flag("--kv-cache-bytes", "byte budget of the prefill/decode KV block pool (0: 256 MiB "
                               "on the CPU); on CUDA the pool takes what --gpu-memory-utilization leaves and a "
                               "non-zero value caps it (workers/runtime/devices.py)", default=0, type=int)
    block_size: int = flag("--block-size", "tokens per KV block", default=DEFAULT_BLOCK_SIZE, type=int)
    connector: str = no_flag("name of the connector backend for the KV handoff",
                             "the stage pipeline's edge (omni-worker's --stage-configs-path, else --connector)",
                             default="shared_memory")
    connector_options: dict = no_flag("the connector backend's options",
                                      "the stage pipeline's edge, topped up by omni-worker's --connector-options",
                                      default_factory=dict)
    heartbeat_interval_s: float = flag("--heartbeat-interval", "seconds between heartbeats to the broker",
                                       default=1.0, type=float)
    stream_chunk_tokens: int = flag("--stream-chunk-tokens", "decode: stream a spoken reply's states to the "
                                    "generate stage in chunks of N new tokens while the reply is written (0: "
                                    "whole, after its last token; default: the stage's "
                                    "runtime.stream_chunk_tokens)", default=0, type=int, cli_default=None)
    wedged_after_s: float = flag("--wedged-after", "seconds one engine step may run before the worker counts as "
                                 "wedged: its keepalives stop, so the broker drops it and re-dispatches what it "
                                 "held (workers/runtime/broker_link.py)", default=300.0, type=float)
    drain_timeout_s: float = flag("--drain-timeout", "on SIGTERM, seconds in-flight requests may take before "
                                  "they are aborted", default=30.0, type=float)
    dtype: str = flag("--dtype", "model dtype: auto (the checkpoint's torch_dtype: bfloat16 for real "
                      "checkpoints, float32 where the CPU lacks native bf16; workers/runtime/dtypes.py), float32, "
                      "bfloat16 or float16", default="auto", choices=dtypes.CHOICES)
    quantization: str | None = flag("--quantization", "prefill/decode of a causal LM: int8 quantizes a float "
                                    "checkpoint's linear weights at load (W8A8: int8 weights per channel, int8 "
                                    "activations per token); compressed-tensors names a quantized checkpoint's "
                                    "own format, which is detected when the flag is left out "
                                    "(workers/llm/quantization.py; default: the stage's "
                                    "engine_args.quantization, else as the checkpoint stores its weights)",
                                    default=None, cli_default=None, parse=_unset_if_empty)
    tensor_parallel_size: int = flag("--tensor-parallel-size", "ranks splitting heads and MLP columns (rank 0 is "
                                     "this process)", default=1, type=int)
    pipeline_parallel_size: int = flag("--pipeline-parallel-size", "ranks splitting the layers into ranges",
                                       default=1, type=int)
    max_num_batched_tokens: int = flag("--max-num-batched-tokens", "prefill tokens per engine step; longer "
                                       "prompts are chunked", default=256, type=int)
    prefix_caching: bool = flag("--no-prefix-caching", "prefill recomputes every prompt (default: it reuses the "
                                "KV blocks of earlier prompts with the same prefix)", default=True,
                                action="store_true", cli_default=False, parse=lambda off: not off)
    kv_transfer: str = flag("--kv-transfer", "prefill: how the KV leaves: layerwise puts each layer's KV while "
                            "the later layers compute (a single-process worker; a TP/PP group always exports "
                            "whole), whole after the forward, auto layerwise only for a step with at least "
                            "16 MiB of KV to send (default: the stage's engine_args.kv_transfer, else auto)",
                            default="auto", choices=("auto", "layerwise", "whole"), cli_default=None)
    threads: int = flag("--threads", "torch intra-op threads (per rank)", default=1, type=int)
    devices: tuple[int, ...] = flag("--devices", "CUDA device ids of this worker's group, e.g. 0,1: rank i on "
                                    "the i-th; they must number tensor x pipeline (x sequence) parallel size "
                                    "(default: cuda:0..N-1 on a host with CUDA, else the CPU)", default=(),
                                    cli_default=None, parse=parse_device_ids)
    gpu_memory_utilization: float = flag("--gpu-memory-utilization", "CUDA: share of each device's memory the "
                                         "worker fills, weights and memory already in use included; the KV pool "
                                         "gets the rest of that share", default=0.9, type=float)
    sequence_parallel_size: int = flag("--sequence-parallel-size", "generate: ranks splitting a diffusion "
                                       "transformer's image or video tokens (SD3, Z-Image, Wan; default: the "
                                       "stage's engine_args.sequence_parallel_size, else 1)", default=1, type=int,
                                       cli_default=None)
    cache_backend: str = flag("--cache-backend", "generate (Wan): diffusion step caching, vLLM-Omni's flag: "
                              "none, tea_cache or static (omnirelay/step_cache_params.py); a request's "
                              "cache_backend replaces it", default="none")
    cache_config: str = flag("--cache-config", "generate: the step cache's JSON, e.g. '{\"rel_l1_thresh\": 0.2}' "
                             "(tea_cache) or '{\"interval\": 2}' (static)", default="")
    expert_parallel: bool = flag("--enable-expert-parallel", "prefill/decode of a mixture-of-experts model: the "
                                 "tensor-parallel ranks hold whole experts (contiguous blocks) and exchange "
                                 "tokens by all-to-all instead of each holding a slice of every expert; the "
                                 "experts must divide by --tensor-parallel-size (default: the stage's "
                                 "engine_args.enable_expert_parallel)", default=False, action="store_true",
                                 cli_default=None)
    lora: LoraOptions | None = flag_group(   # None: off
        ("--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank", "--max-cpu-loras"),
        "prefill and decode of a causal LM: serve LoRA adapters (omnirelay/lora_modules.py; default: the "
        "stage's engine_args LoRA keys)", add=lora_modules.add_arguments, read=lora_modules.options_from_args,
        default=None)
    speculative: SpeculativeConfig | None = flag(   # None: off
        "--speculative-config", "decode: speculative decoding, vLLM's JSON, e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 5, \"prompt_lookup_max\": 4}' (omnirelay/speculative.py; default: the "
        "stage's engine_args.speculative_config)", default=None, cli_default=None, parse=speculative.parse)

    def _on_cuda(self) -> bool:
        """Whether this worker's ranks run on CUDA (named devices, or a host with CUDA: resolve_devices)."""
        if self.devices:
            return True
        import torch
        return torch.cuda.is_available()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not os.path.isdir(self.model_path):
            raise ValueError(f"model directory {self.model_path!r} does not exist")
        if self.kv_transfer not in ("auto", "layerwise", "whole"):
            raise ValueError(f"kv_transfer must be 'auto', 'layerwise' or 'whole', got {self.kv_transfer!r}")
        if self.dtype not in dtypes.CHOICES:
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.dtype == "auto":   # resolved once here: every role reads config.dtype as a torch dtype name
            object.__setattr__(self, "dtype", dtypes.resolve_dtype("auto", self.model_path, self._on_cuda()))
        if self.wedged_after_s <= 2 * self.heartbeat_interval_s:
            raise ValueError(f"--wedged-after {self.wedged_after_s} must exceed two heartbeat intervals "
                             f"({2 * self.heartbeat_interval_s} s): a slow step is not a wedged one")
        if self.capacity < 0 or self.block_size < 1 or self.kv_cache_bytes < 0 or self.stream_chunk_tokens < 0:
            raise ValueError("capacity and block_size must be positive, kv_cache_bytes not negative")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization {self.gpu_memory_utilization}: must be in (0, 1]")
        group = self.tensor_parallel_size * self.pipeline_parallel_size * self.sequence_parallel_size
        if self.devices and len(self.devices) != group:
            raise ValueError(f"--devices {','.join(map(str, self.devices))} names {len(self.devices)} device(s) but "
                             f"the group is --tensor-parallel-size {self.tensor_parallel_size} × "
                             f"--pipeline-parallel-size {self.pipeline_parallel_size}"
                             + (f" × --sequence-parallel-size {self.sequence_parallel_size}"
                                if self.sequence_parallel_size > 1 else "") + f" = {group}")
        if min(self.tensor_parallel_size, self.pipeline_parallel_size, self.sequence_parallel_size,
               self.max_num_batched_tokens, self.threads) < 1:
            raise ValueError("parallel sizes, max_num_batched_tokens and threads must be >= 1")
        # The chosen engine checks the rest against the model's metadata before anything loads
        # (omnirelay.workers.role_table.check_config): this layer imports no engine.
        if self.sequence_parallel_size != 1 and self.role != "generate":
            raise ValueError(f"sequence_parallel_size {self.sequence_parallel_size}: only generate workers "
                             "(diffusion transformers) run sequence parallelism")
        if self.expert_parallel and self.role not in ("prefill", "decode"):
            raise ValueError(f"--enable-expert-parallel: only prefill and decode workers run a language model, "
                             f"not {self.role}")
        if self.quantization is not None and self.role not in ("prefill", "decode"):
            raise ValueError(f"--quantization: only prefill and decode workers run a language model, not {self.role}")
        if self.quantization is not None:
            quantization_methods.check_requested(self.quantization)
        if self.speculative is not None and self.role != "decode":
            raise ValueError(f"--speculative-config: only decode workers speculate, not {self.role}")
        if self.speculative is not None and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError("--speculative-config: needs a single-process decode worker (tensor and pipeline "
                             "parallel size 1): a parallel group returns the last token's logits only")
        if not self.worker_id:
            object.__setattr__(self, "worker_id",
                               f"{self.role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        if not self.capacity:
            object.__setattr__(self, "capacity", 64 if self.role == "decode" else 8)
