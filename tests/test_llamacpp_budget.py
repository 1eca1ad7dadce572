"""llama.cpp's placement at a VRAM budget (strata_core/tools/llamacpp_budget.py): the smallest
``--n-cpu-moe`` whose estimate fits, what each part counts, and `strata bench --vram-budget-gib`'s line."""

from __future__ import annotations

import shlex

import pytest
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_core.cli import main as strata_main
from strata_core.gguf.reader import GGUFFile
from strata_core.model.registry import load_model_spec
from strata_core.tools.llamacpp_budget import (UBATCH, llama_bench_commands, llama_cache_type,
                                               n_cpu_moe_for_budget, placement_at)
from strata_core.tools.synthetic import write_synthetic


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    path = tmp_path_factory.mktemp("budget") / "small.gguf"
    write_synthetic(path, "tiny", expert_type=Q.Q4_K, progress=False, n_layers=3)
    gguf_file = GGUFFile.open(path)
    return path, {name: t.nbytes for name, t in gguf_file.tensors.items()}, load_model_spec(gguf_file)


def test_each_layer_in_host_ram_takes_exactly_its_experts_off_the_gpu(small):
    _, sizes, spec = small
    experts = [sum(n for name, n in sizes.items() if name.startswith(f"blk.{i}.") and "_exps." in name)
               for i in range(spec.n_layers)]
    everything_but_embedding = sum(n for name, n in sizes.items() if not name.startswith("token_embd."))
    for n in range(spec.n_layers + 1):
        placed = placement_at(sizes, spec, n, context=512)
        assert placed.weights == everything_but_embedding - sum(experts[:n])
        assert placed.buffers == UBATCH * (spec.vocab_size + 16 * spec.hidden_size) * 4
    # f16 K and V of every layer for the context
    assert placed.kv == spec.n_layers * 2 * spec.n_kv_heads * spec.head_dim * 2 * 512


@settings(max_examples=50, deadline=None)
@given(fraction=st.floats(0.0, 1.2))
def test_the_placement_is_the_fewest_expert_layers_in_host_ram_that_fit(small, fraction):
    _, sizes, spec = small
    most, least = placement_at(sizes, spec, 0, 256).total, placement_at(sizes, spec, spec.n_layers, 256).total
    budget = int(least + fraction * (most - least))
    placed = n_cpu_moe_for_budget(sizes, spec, budget, 256)
    if budget < least:
        assert placed is None
        return
    assert placed is not None and placed.total <= budget
    if placed.n_cpu_moe:
        assert placement_at(sizes, spec, placed.n_cpu_moe - 1, 256).total > budget


def test_the_commands_run_llama_bench_with_that_placement(small):
    path, _, _ = small
    prefill, decode = map(shlex.split, llama_bench_commands(path, 7, [8192, 32768], 64, [1024, 32768], 16))
    for args in (prefill, decode):
        assert args[0] == "llama-bench" and args[args.index("-ncmoe") + 1] == "7"
        assert args[args.index("-ngl") + 1] == "99" and args[args.index("-fa") + 1] == "1"
        assert args[args.index("-t") + 1] == "16" and args[args.index("-m") + 1] == str(path)
    assert prefill[prefill.index("-p") + 1] == "8192,32768" and prefill[prefill.index("-n") + 1] == "0"
    assert prefill[prefill.index("-b") + 1] == "32768" and "-d" not in prefill
    assert decode[decode.index("-p") + 1] == "0" and decode[decode.index("-n") + 1] == "64"
    assert decode[decode.index("-d") + 1] == "1024,32768"
    assert llama_bench_commands(path, 7, [], 64, [1024], 16) == [shlex.join(decode[:-2] + ["-d", "1024"])]


def test_a_quantized_kv_type_is_compared_with_llama_cpp_s_q8_0_cache(small):
    """``--kv-type q8_0`` (and int8, fp8: llama.cpp has no per-head scales) is measured against llama.cpp's
    q8_0 cache (``-ctk q8_0 -ctv q8_0``), whose 34 bytes a block of 32 values the estimate counts."""
    path, sizes, spec = small
    assert [llama_cache_type(t) for t in ("auto", "bf16", "q8_0", "int8", "fp8")] == ["f16", "bf16", "q8_0",
                                                                                     "q8_0", "q8_0"]
    f16, q8 = placement_at(sizes, spec, 0, 512), placement_at(sizes, spec, 0, 512, "q8_0")
    assert q8.kv == spec.n_layers * 2 * spec.n_kv_heads * spec.head_dim // 32 * 34 * 512 < f16.kv
    assert q8.weights == f16.weights
    for line in llama_bench_commands(path, 3, [8192], 64, [32768], 16, "q8_0"):
        args = shlex.split(line)
        assert args[args.index("-ctk") + 1] == args[args.index("-ctv") + 1] == "q8_0"
    assert all("-ctk" not in line for line in llama_bench_commands(path, 3, [8192], 64, [32768], 16))


def test_bench_with_a_budget_prints_llama_cpp_s_command(small, capsys):
    path, sizes, spec = small
    strata_main(["bench", "--model", str(path), "--devices", "cpu", "--prompts", "16", "--contexts", "16",
                 "--decode-tokens", "2", "--repeats", "1", "--reserve-mib", "0", "--vram-budget-gib", "1"])
    out = capsys.readouterr().out
    assert "vram_budget_gib=1" in out
    lines = [shlex.split(line) for line in out.splitlines() if line.startswith("llama-bench ")]
    assert len(lines) == 2  # prefill, then decode
    assert all(args[args.index("-ncmoe") + 1] == "0" for args in lines)  # a 1 GiB budget holds the tiny model
    assert lines[0][lines[0].index("-n") + 1] == "0" and lines[1][lines[1].index("-p") + 1] == "0"
    assert lines[1][lines[1].index("-d") + 1] == "16" and lines[1][lines[1].index("-n") + 1] == "2"


def test_bench_with_a_quantized_kv_prints_the_matching_cache_type(small, capsys):
    path, _, _ = small
    strata_main(["bench", "--model", str(path), "--devices", "cpu", "--prompts", "16", "--contexts", "16",
                 "--decode-tokens", "2", "--repeats", "1", "--reserve-mib", "0", "--vram-budget-gib", "1",
                 "--kv-type", "q8_0"])
    out = capsys.readouterr().out
    lines = [shlex.split(line) for line in out.splitlines() if line.startswith("llama-bench ")]
    assert len(lines) == 2 and all(args[args.index("-ctk") + 1] == "q8_0" for args in lines)
    assert "(q8_0)" in out
