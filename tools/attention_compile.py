"""Compile the bf16 decode attention kernel (``_attention_split_kernel`` of strata_core/ops/decode.py) for a
CUDA target on any machine, a GPU or not, and print what each configuration costs: registers, spill bytes,
shared memory and the global loads of its PTX by width (``ld.global.b16``: one bf16 value; ``ld.global.v4``:
16 bytes; ``cp.async.cg`` 16 bytes: a pipelined tile copy).

    python tools/attention_compile.py [--block-n 16,32,64,128] [--stages 1,2,3] [--arch 90]

At the Qwen3-30B-A3B shapes (D 128, 8 query heads a kv head: RP 16, 16-token blocks, 4 warps), the pointer
arguments specialised 16-byte aligned as a launch specialises them. Registers and spills come from the cubin
(``cuobjdump -res-usage`` of Triton's nvidia backend); load counts are static instructions of one thread.
Copied into an older tree it compiles that tree's kernel (without ``STAGES``: its plain loop) for a before/after.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from strata_core.ops import decode

POINTERS = {"q": "*bf16", "pos": "*i64", "table": "*i64", "m_out": "*fp32", "l_out": "*fp32", "acc_out": "*fp32"}
SCALARS = {"n_heads": "i32", "n_kv": "i32", "scale": "fp32"}
LOADS = re.compile(r"(ld\.global[.\w]*|cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)?)")


def compile_one(block_n: int, stages: int, arch: int) -> dict:
    kernel = decode._attention_split_kernel
    params = list(inspect.signature(kernel.fn).parameters)
    signature = {p: POINTERS.get(p) or SCALARS.get(p) or "constexpr" for p in params}
    constants = dict(REP=8, RP=16, D=128, SPLITS=64, BS=16, IEEE=False, BLOCK_N=block_n)
    if "STAGES" in params:  # a tree before the stages knob compiles its plain loop (Triton's default: 3)
        constants["STAGES"] = stages
    aligned = [*POINTERS, "n_heads"]  # n_heads (32) a multiple of 16, as a launch specialises it
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(params.index(k),): v for k, v in constants.items()},
                       attrs={(params.index(p),): [["tt.divisibility", 16]] for p in aligned})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=4))
    tools = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    return dict(block_n=block_n, stages=stages, registers=int(re.search(r"REG:(\d+)", usage).group(1)),
                stack=int(re.search(r"STACK:(\d+)", usage).group(1)), shared=compiled.metadata.shared,
                loads=dict(collections.Counter(LOADS.findall(compiled.asm["ptx"]))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-n", default="16,32,64,128")
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    for block_n in map(int, args.block_n.split(",")):
        for stages in map(int, args.stages.split(",")):
            row = compile_one(block_n, stages, args.arch)
            loads = ", ".join(f"{n} {k}" for k, n in sorted(row["loads"].items()))
            print(f"BLOCK_N {block_n:3d} STAGES {stages}: {row['registers']:3d} registers, stack {row['stack']} B, "
                  f"shared {row['shared']} B; loads: {loads}", flush=True)


if __name__ == "__main__":
    main()
