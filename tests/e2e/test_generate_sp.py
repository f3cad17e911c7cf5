"""Sequence parallelism wired into a generate worker: a real ``omni-worker --role generate`` whose
diffusion transformer runs over two gloo ranks (``sequence_parallel_size: 2`` in its stage YAML),
behind the real broker and gateway, makes the same images as the single-rank worker; sizes the
group cannot split are refused — at start-up from the model's metadata, per request with a 400. A
rank killed with SIGKILL (idle, or while a request runs) fails the request with a structured,
retryable 503, and the worker exits with status 1 for its supervisor to restart, leaving no rank.
A rank lost while the group starts (killed, or a model directory it cannot load) fails start-up
within seconds, naming the rank and how it ended, instead of after the rendezvous timeout.

Equality: the PNG pixels are compared, allowing one level of 255 on a vanishing fraction of
pixels. Why not bytes: the two-rank forward computes each rank's projections and MLPs on a slice
of the tokens, so a GEMM may block its sums differently and round the last float bit differently
(attention itself sums the same keys in the same order); a difference of ~1e-7 in a pixel that
sits on a .5 boundary flips its 8-bit value. On this machine the images come out byte-identical.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import openai
import pytest
import torch

from omnirelay.deploy.builders.llm import main as make_model
from omnirelay.pipeline import PipelineError, parse_pipeline
from omnirelay.deploy.serve import build_parser, check_parallel, worker_commands
from omnirelay.deploy.served_models import plan_models
from omnirelay.workers.generate.sequence_parallel_group import (SequenceParallelDenoiser, SequenceParallelError,
                                                      SequenceParallelGroupLost, check_sequence_parallel)

from cluster import Cluster, is_structured_error
from sequence_parallel_support import (alive, assert_same_images, children, generate_png, group_stats, only_worker,
                                      serve_one_rank_then_two, sp_yaml, start_fleet)
from repo_paths import REPO_ROOT

MODEL = "tiny-dit"
PIPELINE_YAML = str(REPO_ROOT / "deploy" / "pipelines" / "text_to_image.yaml")
PROMPT = "a lighthouse on a rocky coast during a storm"
# (size, guidance): guided doubles the batch the ranks see (classifier-free guidance); 96x64 is 6×4 tokens.
REQUESTS = [("64x64", 5.0), ("96x64", 1.0)]


@pytest.fixture(scope="module")
def tiny_dit(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("models") / MODEL
    assert make_model(["tiny-dit", str(path)]) == 0   # omni-make-model tiny-dit DIR
    return str(path)


def _generate(client, size: str, guidance: float, seed: int = 11) -> np.ndarray:
    return generate_png(client, MODEL, PROMPT, size, {"seed": seed, "num_inference_steps": 2,
                                                      "guidance_scale": guidance})


def _sp_ranks(pid: int) -> dict[int, int]:
    """The sequence-parallel rank processes ``pid`` started: rank -> pid, from their command lines."""
    ranks = {}
    for child in children(pid):
        try:
            argv = pathlib.Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "omnirelay.workers.generate.sequence_parallel_group" in argv:
            ranks[int(argv[argv.index("--rank") + 1])] = child
    return ranks


def _cpu_ticks(pid: int) -> int:
    """User + system CPU time of a process, in clock ticks."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_two_rank_worker_makes_the_single_rank_workers_images(tiny_dit, tmp_path):
    with Cluster(model=tiny_dit, log_dir=str(tmp_path), model_name=MODEL) as cluster:
        client, split, reference = serve_one_rank_then_two(
            cluster, PIPELINE_YAML, tmp_path, lambda client: [_generate(client, *request) for request in REQUESTS])
        ranks = children(split.pid)
        assert len(ranks) == 1, ranks   # rank 1, started by the worker (rank 0)
        images = [_generate(client, size, guidance) for size, guidance in REQUESTS]
        assert_same_images(images, reference, [size for size, _ in REQUESTS])

        # 48x48 is 3×3 patches of 16 pixels: nine tokens do not split over two ranks.
        with pytest.raises(openai.BadRequestError) as info:
            _generate(client, "48x48", 1.0)
        assert info.value.status_code == 400 and "sequence-parallel" in str(info.value)
        # Beyond the transformer's table of positions (32 patches of 16 pixels): refused before the
        # ranks see it, so the group stays in step.
        with pytest.raises(openai.BadRequestError, match="at most 512 pixels a side"):
            _generate(client, "1024x512", 1.0)
        # Every denoising forward ran through the group: 2 steps × 2 images (batch 2 when guided: one call).
        stats = group_stats(cluster)
        assert stats["sp_forwards"] == 4 and stats["images_generated"] == 2
        assert split.stop() == 0   # SIGTERM: drains, closes the engine, which stops and joins rank 1
    assert not any(alive(pid) for pid in ranks)
    assert "Traceback" not in split.output(), split.output()[-3000:]


def _fails_recoverably(request) -> float:
    """Run ``request``; it must fail with the gateway's structured error, a 503 the client may retry
    (the worker is lost, or none is left for now). Returns the seconds it took."""
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as info:
        request()
    elapsed = time.monotonic() - started
    body = info.value.response.json()
    assert info.value.status_code == 503 and is_structured_error(body), (info.value.status_code, body)
    assert body["error"]["code"] in ("worker_lost", "unavailable"), body
    return elapsed


def _exits_for_a_restart(worker, ranks: list[int], timeout: float = 60.0) -> None:
    """The worker stops by itself with a non-zero status (so omni-serve or systemd restarts it) and
    leaves no rank process behind."""
    assert worker.proc.wait(timeout) == 1, worker.output()[-3000:]
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in ranks)
    assert "sequence-parallel group lost" in worker.output()
    assert "Traceback" not in worker.output(), worker.output()[-3000:]


def test_a_lost_rank_fails_requests_and_the_worker_exits_for_a_restart(tiny_dit, tmp_path):
    cluster = Cluster(model=tiny_dit, log_dir=str(tmp_path), model_name=MODEL)
    two_ranks = sp_yaml(tmp_path, 2)
    try:
        idle, client = start_fleet(cluster, two_ranks, two_ranks, 2)
        ranks = children(idle.pid)
        assert len(ranks) == 1, ranks

        # An idle worker: rank 1 is killed, then a request comes. It fails at once with a structured
        # 503 (the worker noticed and left, or reported the request worker_lost), never hangs.
        os.kill(ranks[0], signal.SIGKILL)
        assert _fails_recoverably(lambda: _generate(client, "64x64", 1.0)) < 30
        _exits_for_a_restart(idle, ranks)
        deadline = time.monotonic() + 10
        while cluster.workers() and time.monotonic() < deadline:   # it unregistered on its way out
            time.sleep(0.2)
        assert cluster.workers() == []

        # A request in flight: rank 1 dies while the group denoises it (the largest size, guided, the
        # most steps: many seconds). The pipeline's whole call is one engine step, so no heartbeat
        # tells when it runs; rank 1's CPU time does (an idle rank waits in a broadcast).
        busy = cluster.start_worker("generate", "--stage-configs-path", two_ranks)
        only_worker(cluster, 2)
        ranks = children(busy.pid)
        idle_ticks, restarts = _cpu_ticks(ranks[0]), cluster.broker_counters().get("request_restarts", 0)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            slow = pool.submit(_fails_recoverably, lambda: client.images.generate(
                model=MODEL, prompt=PROMPT, size="512x512",
                extra_body={"seed": 1, "num_inference_steps": 150, "guidance_scale": 5.0}))
            deadline = time.monotonic() + 60
            while _cpu_ticks(ranks[0]) < idle_ticks + 50:   # half a second of work at 100 ticks/s
                assert time.monotonic() < deadline and not slow.done(), "the request never reached the group"
                time.sleep(0.1)
            killed = time.monotonic()
            os.kill(ranks[0], signal.SIGKILL)
            slow.result(timeout=60)
            # (The gateway resubmits while no worker is live, as while one restarts: seconds.)
            assert time.monotonic() - killed < 30
        _exits_for_a_restart(busy, ranks)
        # The request in flight was reported worker_lost, not as a 500: the broker restarted it (it
        # found no worker left, so the client got the 503).
        assert cluster.broker_counters()["request_restarts"] > restarts
        assert "failing 1 held request(s) as worker_lost" in busy.output()
    finally:
        cluster.stop()


def _transformer(model_path: str):
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel.from_pretrained(model_path, subfolder="transformer", local_files_only=True).eval()


def test_a_rank_killed_during_start_up_fails_it_at_once_and_no_rank_is_left(tiny_dit):
    # Rank 0 in this process (as the worker's build_generate_role does it): ranks 1 and 2 start, rank
    # 1 is killed while it loads. attach fails without entering the rendezvous, names the rank, and
    # stops rank 2 (this process lives on, so the kernel's parent-death signal does not do it).
    group = SequenceParallelDenoiser(tiny_dit, 3)
    try:
        ranks = _sp_ranks(os.getpid())
        assert sorted(ranks) == [1, 2], ranks
        os.kill(ranks[1], signal.SIGKILL)
        transformer = _transformer(tiny_dit)
        started = time.monotonic()
        with pytest.raises(SequenceParallelGroupLost, match=rf"^sequence-parallel rank 1 \(pid {ranks[1]}\) was "
                                                            r"killed by signal 9 \(SIGKILL\) during start-up"):
            group.attach(transformer)
        assert time.monotonic() - started < 15   # not the rendezvous timeout (120 s)
        assert not any(alive(pid) for pid in ranks.values())
        assert _sp_ranks(os.getpid()) == {}
        assert "forward" not in transformer.__dict__   # attach replaced nothing
    finally:
        group.close()   # after a failed attach: nothing left to stop


def test_a_rank_that_cannot_load_the_model_fails_start_up_with_its_exit_status(tiny_dit, tmp_path):
    # The ranks' model directory does not exist (rank 0's transformer comes from elsewhere): rank 1
    # raises while it loads and exits with status 1; its traceback goes to this process's stderr.
    group = SequenceParallelDenoiser(str(tmp_path / "missing"), 2)
    try:
        [pid] = _sp_ranks(os.getpid()).values()
        with pytest.raises(SequenceParallelGroupLost, match=rf"^sequence-parallel rank 1 \(pid {pid}\) exited with "
                                                            r"status 1 during start-up, .* this worker's stderr"):
            group.attach(_transformer(tiny_dit))
        assert not alive(pid)
    finally:
        group.close()


def test_a_worker_whose_rank_dies_during_start_up_exits_1_at_once(tiny_dit, tmp_path):
    # omni-worker with two ranks; rank 1 is killed as soon as it is started (it is still importing),
    # while the worker loads its pipeline. The worker exits 1 as soon as that is loaded, saying which
    # rank died and how, instead of waiting out the rendezvous.
    log_path = tmp_path / "worker.log"
    with open(log_path, "w") as log_file:
        worker = subprocess.Popen([sys.executable, "-m", "omnirelay.workers.daemon", "--role", "generate", "--model",
                                   tiny_dit, "--broker", "tcp://127.0.0.1:9", "--sequence-parallel-size", "2"],
                                  stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (ranks := _sp_ranks(worker.pid)):
            assert time.monotonic() < deadline and worker.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.05)
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        assert worker.wait(120) == 1, log_path.read_text()[-3000:]
        output = log_path.read_text()
        # The worker's pipeline load (seconds) plus a poll; the rendezvous timeout would be 120 s.
        assert time.monotonic() - killed < 60, output[-3000:]
        assert (f"sequence-parallel rank 1 (pid {ranks[1]}) was killed by signal 9 (SIGKILL) during start-up"
                in output), output[-3000:]
        assert "omni-worker generate ready" not in output and not alive(ranks[1])
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_sizes_the_group_cannot_split_fail_fast(tiny_dit, tmp_path):
    with pytest.raises(SequenceParallelError, match=r"size 3 does not divide the 16 image tokens .* use one of "
                                                    r"\[1, 2, 4, 8, 16\]"):
        check_sequence_parallel(tiny_dit, 3)
    check_sequence_parallel(tiny_dit, 4)
    unet_dir = tmp_path / "sd"
    unet_dir.mkdir()
    (unet_dir / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline", '
                                               '"unet": ["diffusers", "UNet2DConditionModel"]}')
    with pytest.raises(SequenceParallelError, match="a UNet .UNet2DConditionModel.; use sequence_parallel_size 1"):
        check_sequence_parallel(str(unet_dir), 2)
    # The worker refuses before loading anything, with the reason on stderr and exit status 2
    # (the flag here; the stage YAML's engine_args.sequence_parallel_size goes the same way).
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "omnirelay.workers.daemon", "--role", "generate", "--model",
                           tiny_dit, "--broker", "tcp://127.0.0.1:9", "--sequence-parallel-size", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "sequence-parallel size 3 does not divide the 16 image tokens" in proc.stderr
    assert time.monotonic() - started < 60
    with pytest.raises(PipelineError, match=r"stages\[0\].engine_args.sequence_parallel_size: only generate"):
        parse_pipeline({"stages": [{"role": "prefill", "engine_args": {"sequence_parallel_size": 2}},
                                   {"role": "decode"}]})
    with pytest.raises(PipelineError, match="must be a positive integer"):
        parse_pipeline({"stages": [{"role": "generate", "engine_args": {"sequence_parallel_size": 0}}]})


def test_devices_for_a_sequence_parallel_worker_fail_fast(tiny_dit, monkeypatch):
    # The group numbers TP × PP × SP ranks; a device list of another length is refused at start-up.
    def worker(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "omnirelay.workers.daemon", "--role", "generate", "--model",
                               tiny_dit, "--broker", "tcp://127.0.0.1:9", "--sequence-parallel-size", "2", *flags],
                              capture_output=True, text=True, timeout=120)

    proc = worker("--devices", "0")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("--devices 0 names 1 device(s) but the group is --tensor-parallel-size 1 × --pipeline-parallel-size 1 × "
            "--sequence-parallel-size 2 = 2") in proc.stderr
    if not torch.cuda.is_available():   # as an LLM worker's: no silent fall-back to the CPU
        proc = worker("--devices", "0,1")
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "--devices 0,1: this host has no CUDA device" in proc.stderr
    # With CUDA the list is right, but the group runs on the CPU (gloo): refused, not ignored.
    from omnirelay.workers import daemon
    from omnirelay.workers.runtime.config import WorkerConfig
    config = WorkerConfig(role="generate", model_path=tiny_dit, model_name=MODEL, devices=(0, 1),
                          sequence_parallel_size=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="sequence-parallel ranks run on the CPU .gloo. in this build"):
        daemon._resolve_worker_devices(config)
    # Without a list an SP worker needs no CUDA devices, however many ranks it has.
    assert daemon._resolve_worker_devices(dataclasses.replace(config, devices=())) == ("cpu",)


def test_omni_serve_passes_the_stages_sequence_parallel_size(tiny_dit, tmp_path):
    args = build_parser().parse_args([tiny_dit, "--stage-configs-path", sp_yaml(tmp_path, 2)])
    plans = [dataclasses.replace(plan, groups=check_parallel(args, plan))
             for plan in plan_models([(tiny_dit, MODEL)], args.stage_configs_path, args.connector)]
    [command] = worker_commands(args, plans, "ipc:///tmp/unused.sock")
    assert command.role == "generate" and command.group_size == 2
    flag = command.argv.index("--sequence-parallel-size")
    assert command.argv[flag + 1] == "2"
    args = build_parser().parse_args([tiny_dit, "--stage-configs-path", PIPELINE_YAML])
    plans = plan_models([(tiny_dit, MODEL)], args.stage_configs_path, args.connector)
    [command] = worker_commands(args, plans, "ipc:///tmp/unused.sock")
    assert "--sequence-parallel-size" not in command.argv and command.group_size == 1
