"""An engine over several ranks (issue 25): layer_split with stages in other processes, joined by gloo
on loopback. Over three ranks (the hidden state passed rank to rank, two device slots on one rank):
bit-identical logits, greedy text, micro-batched windows and a two-turn conversation against
``single``, only the own layers loaded, a rank that stops answering failed after the timeout; the
same for prefill_main over two (its KV handed off between the ranks); rank 0 on cuda:0 too where
there is one (against the same placement in one process). Over two: the server on
rank 0 answering the OpenAI client, /health naming a killed rank in bounded time and requests
failing with it, a rank with other settings refused."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from strata_core.config import StrataSettings
from strata_core.engine import Engine
from strata_core.errors import ConfigError
from strata_core.plugin.placement import DeviceSlot, LayerPlacement, Placement
from strata_core.remote.group import _difference, chain_links, link_backend
from strata_core.remote.launch import Launch, check_placement, launch_of
from strata_core.runtime.devices import resolve_slots

RANKS = Path(__file__).with_name("remote_ranks.py")
TIMEOUT_S = 3  # remote_ranks.py's --dist-timeout
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
       "OMP_NUM_THREADS": "1"}
BOUND_S = 10  # a killed rank is reported within this


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> Path:
    return tiny_model_factory(n_layers=4, expert_type="Q8_0")


# --- in one process: names, launches, placements ----------------------------------------------------

def test_devices_of_other_ranks_are_parsed_not_checked_here():
    slots = resolve_slots(["cpu", "rank1:cuda:3", "rank2:cpu"], rank=0, memory={(1, "cuda:3"): 7})
    assert [(s.rank, str(s.device), s.memory) for s in slots] == [(0, "cpu", None), (1, "cuda:3", 7), (2, "cpu", None)]
    assert [str(s) for s in slots] == ["cpu#0", "rank1:cuda:3#1", "rank2:cpu#2"]
    with pytest.raises(ConfigError, match="cuda:3 does not exist"):
        resolve_slots(["cpu", "rank1:cuda:3"], rank=1)


def test_launch_from_flags_or_torchrun_and_ranks_checked_against_devices():
    two = {"devices": ["cpu", "rank1:cpu"]}
    assert launch_of(StrataSettings(**two, nnodes=2, node_rank=1, dist_init_addr="h:5")) == Launch(1, 2, "h:5")
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert launch_of(StrataSettings(**two), env) == Launch(0, 2, "10.0.0.1:29500")
    assert launch_of(StrataSettings(), {}) is None
    with pytest.raises(ConfigError, match="--devices names rank 1, but 1 rank"):
        launch_of(StrataSettings(**two), {})
    with pytest.raises(ConfigError, match="needs --dist-init-addr"):
        launch_of(StrataSettings(**two, nnodes=2))
    with pytest.raises(ConfigError, match="rank 2 of 3 has no --devices entry"):
        launch_of(StrataSettings(**two, nnodes=3, dist_init_addr="h:5"))
    with pytest.raises(ValueError, match="--node-rank 2 is not below --nnodes 2"):
        StrataSettings(nnodes=2, node_rank=2)


def test_placements_that_move_state_or_experts_between_ranks_are_refused():
    """State moves only from rank 0's prompt device to a whole decode segment of another rank."""
    slots = (DeviceSlot(0, torch.device("cpu")), DeviceSlot(1, torch.device("cpu"), rank=1))
    split = [(0, range(0, 2)), (1, range(2, 4))]
    check_placement(Placement.stages(split), slots)
    check_placement(Placement.stages(split, prompt_device=0, prompt_peer=False), slots)  # prefill_main
    with pytest.raises(ConfigError, match=r"layers 0..1 decode on cpu#0 and their prompts run on rank1:cpu#1; "
                                          "layer state moves between ranks only from one device slot of rank 0"):
        check_placement(Placement.stages(split, main=0, prompt_device=1, prompt_peer=False), slots)
    half = Placement.stages(split, prompt_device=0, prompt_peer=False)
    partly = Placement(prompt=(*half.prompt[:3], LayerPlacement.local(1)), decode=half.decode)
    with pytest.raises(ConfigError, match=r"layers 2..3 decode on rank1:cpu#1 and their prompts run on cpu#0, "
                                          "rank1:cpu#1"):
        check_placement(partly, slots)
    with pytest.raises(ConfigError, match="layer 2 \\(prompt\\) on cpu#0 reads from rank1:cpu#1, a device of another"):
        check_placement(Placement.stages(split, prompt_device=0, prompt_peer=True), slots)
    with pytest.raises(ConfigError, match="main device rank1:cpu#1 must be rank 0's"):
        check_placement(Placement.stages([(1, range(0, 4))]), slots)
    local = LayerPlacement.local(0)
    with pytest.raises(ConfigError, match="reads from rank1:cpu#1, a device of another rank"):
        check_placement(Placement(prompt=(local,), decode=(LayerPlacement(0, (local.experts[0], *local.experts[1:]),
                                                                              attention_peer=1),)), slots)


def test_a_link_between_two_gpus_goes_over_nccl_any_other_over_gloo():
    """The backend per link of a chain (rank 0 -> hops -> rank 0); untested on hardware here."""
    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert link_backend(gpu0, gpu1) == "nccl" and link_backend(gpu0, gpu0) == "nccl"
    assert link_backend(cpu, gpu0) == link_backend(gpu1, cpu) == link_backend(cpu, cpu) == "gloo"
    assert chain_links([(gpu0, gpu1), (cpu, cpu)], gpu0) == ["nccl", "gloo", "gloo"]
    assert chain_links([(gpu0, gpu0)], cpu) == ["gloo", "gloo"]
    assert chain_links([(cpu, gpu1), (gpu0, gpu0)], gpu0) == ["gloo", "nccl", "nccl"]


def test_a_rank_with_another_model_or_settings_is_named():
    ours = {"model file": "m.gguf (10 bytes)", "max_context": 128}
    assert _difference([{"identity": ours}, {"identity": dict(ours)}]) is None
    assert _difference([{"identity": ours}, {"identity": {**ours, "max_context": 64}}]) == (
        "rank 1 was started with --max-context 64, rank 0 with 128: every rank must run the same model file "
        "and settings")
    assert "rank 1 was started with model file 'n.gguf" in _difference(
        [{"identity": ours}, {"identity": {**ours, "model file": "n.gguf (9 bytes)"}}])


# --- two processes ---------------------------------------------------------------------------------

def _ranks(model: Path, n: int, *options: str, stop_last: bool = False) -> dict:
    """Run ``n`` ranks of tests/remote_ranks.py with ``options``: rank 0's findings."""
    port = str(free_port())
    peers = [subprocess.Popen([sys.executable, str(RANKS), str(model), port, str(rank), str(n), *options], env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for rank in range(1, n)]
    stop = ["--stop", str(peers[-1].pid)] if stop_last else []
    try:
        done = subprocess.run([sys.executable, str(RANKS), str(model), port, "0", str(n), *options, *stop], env=ENV,
                              capture_output=True, text=True, timeout=120)
    finally:
        for peer in peers:
            peer.kill()
            peer.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


#: rank 0's device in the tests over several processes (the other ranks compute on the CPU); on CUDA the
#: reference is the same placement in one process, on the CPU single (bit-identical whatever the placement)
MAIN_DEVICES = ["cpu", pytest.param("cuda:0", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs a CUDA device"))]


@pytest.mark.parametrize("main_device", MAIN_DEVICES)
def test_three_ranks_equal_single_and_a_stopped_rank_fails_after_the_timeout(model, main_device):
    found = _ranks(model, 3, "--main-device", main_device, stop_last=True)
    assert found["logits"] and found["greedy"] and found["windows"] and found["turns"], found
    assert found["layers_here"] == [0]  # ranks 1 and 2 compute 1..3: rank 0 never loaded them
    assert found["error"] is not None and found["error"].startswith("rank 2 (rank2:cpu#3, layers 3..3) died or stopped")
    assert TIMEOUT_S - 1 <= found["seconds"] < TIMEOUT_S + BOUND_S  # the heartbeat may have begun waiting first
    assert found["health"] == found["error"]


@pytest.mark.parametrize("main_device", MAIN_DEVICES)
def test_prefill_main_prompts_on_rank_0_and_decodes_on_rank_1_like_single(model, main_device):
    """Every prompt on rank 0, layers 2..3 decoded on rank 1: the KV of those layers handed off over the
    ranks' channel after each prompt and back before the next; logits and greedy text as the reference's."""
    found = _ranks(model, 2, "--strategy", "prefill_main", "--main-device", main_device)
    assert found["logits"] and found["greedy"] and found["windows"] and found["turns"], found
    assert found["layers_here"] == [0, 1, 2, 3]  # the prompt runs every layer on rank 0


def _serve(model: Path, rank: int, dist_port: int, http_port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "strata_core", "serve", "--model", str(model), "--strategy", "layer_split",
         "--devices", "cpu,rank1:cpu", "--max-context", "128", "--parallel", "2", "--nnodes", "2",
         "--node-rank", str(rank), "--dist-init-addr", f"127.0.0.1:{dist_port}", "--dist-timeout", "4",
         "--port", str(http_port), *extra], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait(url: str, ok, bound: float) -> httpx.Response:
    deadline = time.monotonic() + bound
    while True:
        try:
            reply = httpx.get(url, timeout=2)
            if ok(reply):
                return reply
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} not as wanted within {bound} s"
        time.sleep(0.2)


def test_server_on_rank_0_answers_the_openai_client_and_health_names_a_killed_rank(model):
    from openai import APIStatusError, OpenAI

    dist_port, http_port = free_port(), free_port()
    ranks = [_serve(model, rank, dist_port, http_port) for rank in (0, 1)]
    base = f"http://127.0.0.1:{http_port}"
    try:
        _wait(f"{base}/health", lambda r: r.status_code == 200, 90)
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        reply = client.completions.create(model="m", prompt="the experts", max_tokens=8, temperature=0)
        single = Engine.load(model, max_context=128)
        want = single.generate(single.tokenizer.encode("the experts"), max_tokens=8, temperature=0)
        assert reply.choices[0].text == want
        ranks[1].send_signal(signal.SIGKILL)
        start = time.monotonic()
        health = _wait(f"{base}/health", lambda r: r.status_code == 503, BOUND_S)
        assert time.monotonic() - start < BOUND_S
        assert health.json()["status"] == "error" and "rank 1 (rank1:cpu#1, layers 2..3)" in health.json()["error"]
        with pytest.raises(APIStatusError) as failed:
            client.completions.create(model="m", prompt="the experts", max_tokens=4, temperature=0)
        assert failed.value.status_code == 503 and "rank 1" in str(failed.value)
    finally:
        for process in ranks:
            process.kill()
            process.wait()


def test_a_rank_started_with_other_settings_is_refused_at_join(model):
    port = str(free_port())
    ranks = [subprocess.Popen([sys.executable, str(RANKS), str(model), port, str(rank), "2"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env={**ENV, "STRATA_KV_BLOCK": str(16 * (rank + 1))})
             for rank in (0, 1)]
    for process in ranks:
        _, err = process.communicate(timeout=90)
        assert process.returncode != 0
        assert "ConfigError: rank 1 was started with --kv-block 32, rank 0 with 16: every rank must run the same " \
               "model file and settings" in err
