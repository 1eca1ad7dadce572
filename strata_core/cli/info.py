"""``strata info MODEL.gguf``: what a model is and what fits in a given amount of VRAM."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from pydantic import Field
from pydantic_settings import CliPositionalArg

import torch

from strata_core.cli.settings import settings_with
from strata_core.runtime.memory_plan import dense_bytes_per_device
from strata_core.plugin.placement import DeviceSlot, LayerPlacement, Placement
from strata_core.gguf.reader import GGUFFile
from strata_core.errors import ConfigError
from strata_core.model.kvquant import KV_TYPES, token_bytes
from strata_core.model.registry import load_model_spec
from strata_core.text.harmony import uses_harmony

GIB = 1 << 30


def tensor_group(name: str) -> str:
    """``blk.3.ffn_up_exps.weight`` -> ``ffn_up_exps``; ``token_embd.weight`` -> ``token_embd``."""
    parts = name.split(".")
    return parts[2] if parts[0] == "blk" and len(parts) > 2 else parts[0]


def _size(n: int) -> str:
    """``n`` bytes in MiB, or in KiB below one MiB."""
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _layout(name: str, t) -> str:
    """``k [2, 16]``; a tensor of its own dtype says it: ``ssm [4, 8, 8] float32``."""
    return f"{name} {list(t.shape)}" + (f" {str(t.dtype).removeprefix('torch.')}" if t.dtype else "")


def state_line(spec) -> str:
    """KV bytes per token (bf16, every layer's per-token state from ``ModelSpec.layer_state``) with the
    per-layer layouts, and the fixed-size recurrent state of a session, if any, with its layouts."""
    sizes = {True: 0, False: 0}  # per_token -> bytes (per token / per session)
    layouts: dict[bool, dict[str, int]] = {True: defaultdict(int), False: defaultdict(int)}
    for layer in range(spec.n_layers):
        for per_token in (True, False):
            part = {name: t for name, t in spec.layer_state(layer).items() if t.per_token == per_token}
            if part:
                sizes[per_token] += sum(t.nbytes(1, torch.bfloat16) for t in part.values())
                layouts[per_token][" + ".join(_layout(name, t) for name, t in part.items())] += 1
    shown = {k: "; ".join(f"{layout} x {n} layers" for layout, n in v.items()) for k, v in layouts.items()}
    extra = f", plus {_size(sizes[False])} of recurrent state per session ({shown[False]})" if sizes[False] else ""
    return f"KV per token: {sizes[True]} bytes in bf16 ({shown[True]}){extra}\n{kv_types_line(spec)}"


def kv_types_line(spec) -> str:
    """KV bytes per token under each quantized ``--kv-type`` (codes and scales; kvquant.py), or why a type
    cannot store the model's rows."""
    parts = []
    for kv_type in KV_TYPES[2:]:
        try:
            total = sum(token_bytes(spec.layer_state(layer), kv_type) for layer in range(spec.n_layers))
        except ConfigError as error:
            parts.append(f"{kv_type} n/a ({error})")
            continue
        parts.append(f"{kv_type} {total}")
    return "KV per token by --kv-type: " + ", ".join(parts) + " bytes"


def describe(path: Path, vram_gib: list[float], max_context: int = 4096, kv_type: str = "auto") -> str:
    """The report ``strata info`` prints; the KV cache is sized for the context the engine will use
    (``max_context`` capped by the model's, as the engine caps it), its rows stored as ``kv_type``."""
    gguf_file = GGUFFile.open(path)
    spec = load_model_spec(gguf_file)
    kv_tokens = min(max_context, spec.context_length)
    groups: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    expert_bytes = dense_bytes = 0
    for ref in gguf_file.tensors.values():
        group = tensor_group(ref.name)
        groups[group][ref.qtype.name] += ref.nbytes
        if group.endswith("_exps") and ref.name.endswith(".weight"):  # (gpt-oss's expert biases are dense)
            expert_bytes += ref.nbytes
        else:
            dense_bytes += ref.nbytes
    n_expert_total = len(spec.moe_layers) * spec.n_experts
    per_expert = expert_bytes / max(n_expert_total, 1)
    gpu = torch.device("cuda", 0)
    one_gpu = tuple(LayerPlacement.local(0) for _ in range(spec.n_layers))
    on_gpu = dense_bytes_per_device(spec, Placement(one_gpu, one_gpu), {0: DeviceSlot(0, gpu)},
                                    torch.bfloat16, kv_tokens, kv_type)[gpu]
    parts = gguf_file.parts
    lines = [
        f"file: {path}" + (f" (split in {len(parts)} parts: {', '.join(Path(p).name for p in parts)})"
                           if len(parts) > 1 else ""),
        f"architecture: {spec.architecture}",
        f"layers: {spec.n_layers}  hidden: {spec.hidden_size}  heads: {spec.n_heads} (kv {spec.n_kv_heads}, "
        f"head dim {spec.head_dim})  vocab: {spec.vocab_size}",
        f"context: {kv_tokens} tokens used (--max-context {max_context}; the model's is {spec.context_length})",
        state_line(spec),
        f"experts: {spec.n_experts} per layer in {len(spec.moe_layers)} of {spec.n_layers} layers, "
        f"top-{spec.n_experts_used}, expert FFN {spec.expert_ffn_size}"
        + (f", shared expert FFN {spec.shared_expert_ffn_size}" if spec.shared_expert_ffn_size else ""),
        *spec.info_lines(),
        *(["chat template: harmony (the server answers with reasoning_content and content)"]
          if uses_harmony(str(gguf_file.metadata.get("tokenizer.chat_template") or "")) else []),
        "block types per tensor group:",
    ]
    for group in sorted(groups):
        kinds = ", ".join(f"{qtype} {size / 2**20:.1f} MiB" for qtype, size in sorted(groups[group].items()))
        lines.append(f"  {group:<18} {kinds}")
    lines += [
        f"dense weights: {dense_bytes / 2**20:.1f} MiB   expert weights: {expert_bytes / 2**20:.1f} MiB "
        f"({n_expert_total} experts, {per_expert / 2**20:.2f} MiB each)",
    ]
    lines.append(f"on a GPU the dense part is dequantized to bf16: {on_gpu / GIB:.2f} GiB with the KV cache "
                 f"of one {kv_tokens}-token session (--kv-type {kv_type})")
    for gib in vram_gib:
        room = gib * GIB - on_gpu
        if room < 0:
            lines.append(f"  {gib:g} GiB VRAM: the dense part alone ({on_gpu / GIB:.2f} GiB) does not fit")
        else:
            fit = min(n_expert_total, int(room // per_expert)) if per_expert else n_expert_total
            lines.append(f"  {gib:g} GiB VRAM: dense + {fit} of {n_expert_total} experts "
                         f"({100 * fit / max(n_expert_total, 1):.0f}%) before prompt buffers")
    return "\n".join(lines)


class InfoCommand(settings_with(("max_context", "kv_type"))):
    """Show a GGUF model's architecture, block types, sizes and what fits in VRAM."""

    path: CliPositionalArg[Path]
    vram_gib: list[float] = Field(default_factory=lambda: [8.0, 16.0, 24.0, 32.0],
                                  description="VRAM sizes to fit the model into")

    def cli_cmd(self) -> None:
        """Print the report."""
        print(describe(self.path, self.vram_gib, self.max_context, self.kv_type))
