"""Registers and occupancy of the decode MoE kernels for sm_90, compiled offline (no GPU needed).

    python tools/kernel_regs.py [--qtype Q4_K] [--tiles 4096,2048,1024] [--warps 4,8]

Compiles ``_gate_up_kernel`` and ``_down_combine_kernel`` (strata_core/ops/moe_kernels.py) for the H200's
sm_90a with Triton and its bundled ptxas, for each values-per-step tile and warp count, and prints
the registers a thread uses, spills, and the CTAs and warps an SM can hold by registers (grids of
8 pairs x F/BN and 1 token x H/BN programs over 132 SMs bound them further). Needs Triton
(``pip install triton``); the kernels' rows per program are those of ``moe.DEFAULT_LAUNCH`` (``bn_gate_up``,
``bn_combine``).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import triton
from gguf.constants import GGMLQuantizationType as T
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from strata_core.ops import moe, moe_kernels
from strata_core.ops.qdecode import block_geometry

_PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
_INTS = {"slots_base": "i64", "miss_base": "i64", "slot_stride": "i64", "miss_stride": "i64"}


def _signature(kernel, constexprs: dict, pointers: dict) -> dict:
    return {n: "constexpr" if n in constexprs else pointers.get(n, _INTS.get(n, "i32")) for n in kernel.arg_names}


def compile_regs(kernel, constexprs: dict, pointers: dict, warps: int) -> tuple[int, bool]:
    """(registers a thread, spills) of ``kernel`` compiled for sm_90a with ``warps`` warps."""
    compiled = triton.compile(ASTSource(fn=kernel, signature=_signature(kernel, constexprs, pointers),
                                        constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run([str(_PTXAS), "-arch=sm_90a", "-v", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
                                capture_output=True, text=True, check=True).stderr
    regs = int(report.split("Used ")[1].split(" registers")[0])
    return regs, "0 bytes spill stores" not in report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--qtype", default="Q4_K")
    parser.add_argument("--tiles", default="4096,2048,1024")
    parser.add_argument("--warps", default="4,8")
    args = parser.parse_args()
    qtype = T[args.qtype]
    bs, ts, sub = block_geometry(qtype)
    kernels = [
        ("gate_up", moe_kernels._gate_up_kernel, moe.DEFAULT_LAUNCH.bn_gate_up,
         lambda bn, nt: dict(QG=int(qtype), BSG=bs, TSG=ts, SUBG=sub, NTG=nt, QU=int(qtype), BSU=bs, TSU=ts,
                             SUBU=sub, NTU=nt, BN=bn, BY_PAIR=False, BIAS=False, OAI=False),
         dict(x="*bf16", h="*fp32", slot_ptr="*i64", miss_ptr="*i64", tab_g="*fp32", tab_u="*fp32",
              gate_bias="*fp32", up_bias="*fp32", expert_ptr="*i64")),
        ("down_combine", moe_kernels._down_combine_kernel, moe.DEFAULT_LAUNCH.bn_combine,
         lambda bn, nt: dict(QT=int(qtype), BS=bs, TS=ts, SUB=sub, NT=nt, BN=bn, BY_PAIR=False, BIAS=False),
         dict(h="*fp32", out="*bf16", weights="*fp32", slot_ptr="*i64", miss_ptr="*i64", tab="*fp32",
              down_bias="*fp32", expert_ptr="*i64")),
    ]
    for tile in map(int, args.tiles.split(",")):
        for warps in map(int, args.warps.split(",")):
            for name, kernel, bn, constexprs, pointers in kernels:
                nt = max(bs // sub, tile // (bn * sub))
                regs, spills = compile_regs(kernel, constexprs(bn, nt), pointers, warps)
                ctas = min(65536 // ((regs + 7) // 8 * 8 * 32 * warps), 32)
                print(f"{name:13s} BN={bn:2d} tile={tile:5d} warps={warps}: {regs:3d} registers"
                      f"{' (spills)' if spills else ''}, {ctas} CTAs = {ctas * warps} warps an SM by registers")


if __name__ == "__main__":
    main()
