"""Encode engine: a request's images and audio clips → the thinker's input embeddings for them.

Life of a request through this engine::

    add(EncodeTask: media items in prompt order) ──▶ waiting (FIFO)
        ──step(): up to ``max_batch`` requests leave waiting together──▶ each item is looked up in
        the encoder cache by (kind, sha256 of its bytes); misses are decoded and preprocessed
        (Qwen2-VL image processor / Whisper features) ──▶ one vision-encoder forward over every
        missing image of the step, one audio-encoder forward over every missing clip ──▶ outputs
        cached ──▶ per request: image embeddings (all its images, prompt order) and audio embeddings
        (all its clips) ``put`` under ``mm/<request_id>/<attempt>`` by a transfer job
        (:mod:`~omnirelay.workers.encode.embeds_send`) while the next batch encodes ──▶
        EncodeResult(handles + the image grids and audio lengths the prefill needs for M-RoPE), in
        the first step after the put returned (the same step on shared memory, whose writes run inline)

An item that cannot be decoded fails its request (``bad_request``); the gateway validated it, so
this only happens to a client that bypasses the gateway. The cache belongs to this engine (one per
worker replica), bounded by bytes, least recently used first out; a hit skips preprocessing and
the encoder. The engine holds no sockets; the worker runtime feeds it tasks and sends its results.

The encoder never waits on the store: the puts go through the worker's
:class:`~omnirelay.workers.runtime.transfers.TransferPool`, like prefill's and decode's transfers.
At most ``MAX_SENDS`` batches' worth of requests' embeddings are on their way at once; while that
many are stuck (a store that stalls) no new batch starts, so their memory is bounded. A request
cancelled while its put is on its way has its key deleted when the put returns (the pool's cancel);
``close`` deletes every key not yet reported.

Each model family's encoders are a :class:`ThinkerEncoders` (weights, preprocessing) that runs its
own towers: Qwen2.5-Omni's :class:`OmniEncoders` here, Qwen3-Omni's in ``qwen3.py``, whose image
encodings carry the DeepStack features too, which ``image_payload`` splits out (``image_deepstack``).

Models: the thinker's ``visual`` and ``audio_tower`` only, built with transformers' own modules
(``Qwen2_5OmniVisionEncoder``, ``Qwen2_5OmniAudioEncoder``) from the checkpoint's config and the
``thinker.visual.*`` / ``thinker.audio_tower.*`` tensors -- the language model, talker and vocoder
are never loaded here. Outputs equal what ``Qwen2_5OmniThinkerForConditionalGeneration`` merges.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import json
from pathlib import Path

import numpy as np
import torch

from omnirelay.connectors import Connector
from omnirelay.connectors.base import Handle
from omnirelay.errors import BadRequest, DeadlineExceeded, OutOfMemory
from omnirelay.handoffs import MAX_IMAGE_PIXELS_CEILING, EmbedsHandoff, media_key
from omnirelay.workers.encode.embeds_send import EmbedsSend
from omnirelay.workers.runtime.engine import RequestFailure
from omnirelay.workers.runtime.request_queue import RequestQueue
from omnirelay.workers.runtime.transfers import Transfer, TransferPool, TransferState

AUDIO_SAMPLE_RATE = 16000     # the gateway sends audio as float32 little-endian PCM at this rate
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024


@dataclasses.dataclass
class MediaItem:
    kind: str                 # "image" (encoded file bytes: PNG, JPEG, ...) | "audio" (f32le PCM, 16 kHz)
    data: bytes

    @property
    def digest(self) -> str:
        return self.kind + ":" + hashlib.sha256(self.data).hexdigest()


@dataclasses.dataclass
class EncodeTask:
    request_id: str
    items: list[MediaItem]
    deadline: float
    attempt: int = 0


@dataclasses.dataclass
class EncodeResult:
    request_id: str
    outputs: EmbedsHandoff   # for prefill


@dataclasses.dataclass
class _Encoded:
    embeds: torch.Tensor      # [tokens, hidden]
    meta: list[int]           # image: its (t, h, w) patch grid; audio: [mel frames]

    @property
    def nbytes(self) -> int:
        return self.embeds.numel() * self.embeds.element_size()


class ThinkerEncoders:
    """A thinker's vision and audio encoders plus their preprocessors, from a model directory: what
    every family shares (the ``thinker.visual.*`` / ``thinker.audio_tower.*`` weights, the Qwen2-VL
    image processor, Whisper features). A family's subclass reads its config and runs its encoders
    (:class:`OmniEncoders`, :class:`~omnirelay.workers.encode.qwen3.Qwen3OmniEncoders`)."""

    def __init__(self, path: str, dtype: torch.dtype, thinker, visual_class, audio_class):
        from safetensors import safe_open
        from transformers import WhisperFeatureExtractor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.dtype = dtype
        self.visual = visual_class._from_config(thinker.vision_config).to(dtype).eval()
        self.audio = audio_class._from_config(thinker.audio_config).to(dtype).eval()
        for module, prefix in ((self.visual, "thinker.visual."), (self.audio, "thinker.audio_tower.")):
            state = {}
            for file in sorted(Path(path).glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as handle:
                    state.update({k[len(prefix):]: handle.get_tensor(k) for k in handle.keys() if k.startswith(prefix)})
            module.load_state_dict(state, strict=True)
        self.merge = thinker.vision_config.spatial_merge_size
        self.images = Qwen2VLImageProcessorPil.from_pretrained(path)
        self.features = WhisperFeatureExtractor.from_pretrained(path)

    # ---------------------------------------------------------------- preprocessing (per item)

    def image_inputs(self, data: bytes) -> tuple[torch.Tensor, list[int]]:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as img:
            # The gateway checked the header against its limit; this bound holds for any bus peer.
            if img.size[0] * img.size[1] > MAX_IMAGE_PIXELS_CEILING:
                raise ValueError(f"the image declares {img.size[0]}x{img.size[1]} pixels; at most "
                                 f"{MAX_IMAGE_PIXELS_CEILING}")
            rgb = img.convert("RGB")
        out = self.images(images=[rgb], return_tensors="pt")
        return out["pixel_values"], [int(x) for x in out["image_grid_thw"][0]]

    def audio_inputs(self, data: bytes) -> torch.Tensor:
        """Mel features ``[mels, frames]`` of the clip (padding dropped, as the thinker does)."""
        pcm = np.frombuffer(data, dtype="<f4")
        out = self.features([pcm], sampling_rate=AUDIO_SAMPLE_RATE, return_attention_mask=True,
                            padding="max_length", return_tensors="pt")
        frames = int(out["attention_mask"][0].sum())
        return out["input_features"][0, :, :frames]

    # ---------------------------------------------------------------- encoders (batched, per family)

    def encode_images(self, pixels: list[torch.Tensor], grids: list[list[int]]) -> list[torch.Tensor]:
        """Per image ``[tokens, …]``, what the engine caches."""
        raise NotImplementedError

    def encode_audio(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        raise NotImplementedError

    def image_payload(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """A request's image encodings (prompt order, concatenated) as the prefill reads them."""
        return {"image_embeds": images}


class OmniEncoders(ThinkerEncoders):
    """Qwen2.5-Omni's encoders."""

    def __init__(self, path: str, dtype: torch.dtype = torch.float32):
        from transformers import Qwen2_5OmniConfig
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (Qwen2_5OmniAudioEncoder,
                                                                            Qwen2_5OmniVisionEncoder)

        raw = json.loads((Path(path) / "config.json").read_text())
        thinker = Qwen2_5OmniConfig(**raw).thinker_config if "thinker_config" in raw else None
        if thinker is None:
            raise ValueError(f"{path}: not a Qwen2.5-Omni checkpoint (no thinker_config)")
        super().__init__(path, dtype, thinker, Qwen2_5OmniVisionEncoder, Qwen2_5OmniAudioEncoder)

    @torch.inference_mode()
    def encode_images(self, pixels: list[torch.Tensor], grids: list[list[int]]) -> list[torch.Tensor]:
        grid = torch.tensor(grids, dtype=torch.long)
        out = self.visual(torch.cat(pixels).to(self.dtype), grid_thw=grid).pooler_output
        return list(torch.split(out, (grid.prod(-1) // self.merge ** 2).tolist()))

    @torch.inference_mode()
    def encode_audio(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        lens = torch.tensor([f.shape[1] for f in features], dtype=torch.long)
        after_cnn, out_lens = self.audio._get_feat_extract_output_lengths(lens)
        out = self.audio(torch.cat(features, dim=1).to(self.dtype), feature_lens=lens,
                         aftercnn_lens=after_cnn).last_hidden_state
        return list(torch.split(out, out_lens.tolist()))


class EncodeEngine:
    # Batches whose embeddings may be on their way at once; a step with nothing to encode waits at
    # most IDLE_WAIT_S for a put to return (a broker message ends the wait at once: wake()).
    MAX_SENDS = 2
    IDLE_WAIT_S = 0.02

    def __init__(self, encoders: ThinkerEncoders, connector: Connector, *, max_batch: int = 8,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, transfer_timeout_s: float = 30.0):
        self.encoders = encoders
        self.connector = connector
        self.max_batch = max_batch
        self.cache_bytes = cache_bytes
        self.cache: collections.OrderedDict[str, _Encoded] = collections.OrderedDict()
        self._cached_bytes = 0
        self.waiting: RequestQueue[EncodeTask] = RequestQueue()
        self.stats = collections.Counter()
        self._transfers = TransferPool(connector, timeout_s=transfer_timeout_s,
                                       max_held=self.MAX_SENDS * max_batch, name="encode-transfer")
        self._sending: dict[str, Transfer[Handle]] = {}   # request → its embeddings' put

    @property
    def num_requests(self) -> int:
        """Requests waiting: what the worker's credits count (one whose put is on its way uses no
        compute; step() holds new batches back while MAX_SENDS batches' puts are stuck)."""
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self._sending)

    def add(self, task: EncodeTask) -> None:
        self.waiting.add(task)

    def cancel(self, request_id: str) -> bool:
        if self.waiting.remove(request_id) is not None:
            return True
        ticket = self._sending.pop(request_id, None)
        if ticket is not None:
            self._transfers.cancel(ticket)   # its key is deleted when the put returns
        return ticket is not None

    def wake(self) -> None:
        """A broker message is waiting for the loop: end a step's idle wait on puts now."""
        self._transfers.poke()

    def close(self) -> None:
        """Stop the transfer threads, deleting every key put but not yet reported, and join them for at
        most ``TransferPool.CLOSE_JOIN_S``. Call before closing the connector. Idempotent."""
        self._transfers.close()

    def step(self) -> list[EncodeResult | RequestFailure]:
        results: list[EncodeResult | RequestFailure] = []
        self._collect_sent(results)
        results += [RequestFailure(task.request_id, DeadlineExceeded.error_type,
                                   message="deadline passed before encode") for task in self.waiting.pop_expired()]
        batch = []
        if len(self._sending) < self.MAX_SENDS * self.max_batch:
            batch = [self.waiting.popleft() for _ in range(min(self.max_batch, len(self.waiting)))]
        if batch:
            self._encode(batch, results)
        self._collect_sent(results)
        if self._sending and not (batch or results):   # never delays what this step made
            self._transfers.wait_for_news(self.IDLE_WAIT_S)
        return results

    def _collect_sent(self, results: list[EncodeResult | RequestFailure]) -> None:
        """Report the requests whose embeddings' put has returned."""
        for request_id, ticket in [(r, t) for r, t in self._sending.items() if t.finished]:
            del self._sending[request_id]
            if ticket.state is TransferState.FAILED:   # the job deleted its key
                results.append(RequestFailure(request_id, ticket.error.error_type, message=str(ticket.error)))
                continue
            job = ticket.job
            with self._transfers.take(ticket) as handle:
                self.stats["encoded_requests"] += 1
                results.append(EncodeResult(request_id, outputs=EmbedsHandoff(job.name, handle, job.grids, job.lengths)))

    def _encode(self, batch: list[EncodeTask], results: list[EncodeResult | RequestFailure]) -> None:
        """Encode the batch's media and hand each request's embeddings to a transfer job."""
        failed: set[str] = set()
        images: dict[str, tuple[torch.Tensor, list[int]]] = {}
        audio: dict[str, torch.Tensor] = {}
        for task in batch:
            for item in task.items:
                key = item.digest
                if key in self.cache or key in images or key in audio:
                    continue
                try:
                    if item.kind == "image":
                        images[key] = self.encoders.image_inputs(item.data)
                    elif item.kind == "audio":
                        audio[key] = self.encoders.audio_inputs(item.data)
                    else:
                        raise ValueError(f"unknown media kind {item.kind!r}")
                except Exception as exc:   # PIL/numpy raise many types on bad input
                    failed.add(task.request_id)
                    results.append(RequestFailure(task.request_id, BadRequest.error_type,
                                                message=f"cannot decode {item.kind}: {exc}"))
                    break
        if images:
            keys = list(images)
            embeds = self.encoders.encode_images([images[k][0] for k in keys], [images[k][1] for k in keys])
            for key, emb in zip(keys, embeds):
                self._remember(key, _Encoded(emb, images[key][1]))
        if audio:
            keys = list(audio)
            embeds = self.encoders.encode_audio([audio[k] for k in keys])
            for key, emb in zip(keys, embeds):
                self._remember(key, _Encoded(emb, [int(audio[key].shape[1])]))
        self.stats["encoded_images"] += len(images)
        self.stats["encoded_audio"] += len(audio)
        self.stats["encode_steps"] += 1
        for task in batch:
            if task.request_id not in failed:
                finished = self._finish(task, images, audio)
                if isinstance(finished, RequestFailure):
                    results.append(finished)
                else:
                    self._sending[task.request_id] = self._transfers.submit(finished)

    def _remember(self, key: str, encoded: _Encoded) -> None:
        self.cache[key] = encoded
        self._cached_bytes += encoded.nbytes
        while self._cached_bytes > self.cache_bytes and len(self.cache) > 1:
            _, old = self.cache.popitem(last=False)
            self._cached_bytes -= old.nbytes

    def _finish(self, task: EncodeTask, fresh_images: dict, fresh_audio: dict) -> EmbedsSend | RequestFailure:
        parts = {"image": [], "audio": []}
        grids, lengths = [], []
        for item in task.items:
            key = item.digest
            encoded = self.cache.get(key)
            if encoded is None:   # evicted within this step by a larger batch: cannot happen below 1 item
                return RequestFailure(task.request_id, OutOfMemory.error_type,
                                    message="encoder cache too small for one request's media")
            self.cache.move_to_end(key)
            if key not in fresh_images and key not in fresh_audio:
                self.stats["encoder_cache_hits"] += 1
            parts[item.kind].append(encoded.embeds)
            (grids if item.kind == "image" else lengths).append(encoded.meta if item.kind == "image" else encoded.meta[0])
        payload = self.encoders.image_payload(torch.cat(parts["image"])) if parts["image"] else {}
        if parts["audio"]:
            payload["audio_embeds"] = torch.cat(parts["audio"])
        return EmbedsSend(task.request_id, media_key(task.request_id, task.attempt), payload, grids, lengths,
                          task.deadline)
