"""``strata make-synthetic``: write a GGUF with a named model's real shapes and random valid blocks."""

from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType
from pydantic import Field
from pydantic_settings import CliPositionalArg

from strata_core.cli.settings import CommandSettings
from strata_core.errors import ConfigError


def _qtype(name: str, option: str) -> GGMLQuantizationType:
    try:
        return GGMLQuantizationType[name.upper()]
    except KeyError:
        raise ConfigError(f"{option} {name!r} is not a GGML block type (e.g. Q4_K, IQ4_XS, Q8_0)") from None


class MakeSyntheticCommand(CommandSettings):
    """Write a synthetic GGUF (real shapes of --preset, random but valid blocks) for benchmarks and tests."""

    out: CliPositionalArg[Path]
    preset: str = Field("qwen3-30b-a3b", description="model shapes: qwen3-30b-a3b, qwen3-235b-a22b, small, tiny, "
                        "deepseek-v3-small (DeepSeek-V3 widths, 4 layers), deepseek-tiny, qwen3-next-80b-a3b (48 layers: "
                        "--layers 12 builds in seconds), qwen3-next-tiny, gpt-oss-120b (36 layers: --layers 8 builds "
                        "in seconds), gpt-oss-20b, gpt-oss-tiny")
    expert_type: str | None = Field(None, description="block type of the experts (Q4_K, IQ4_XS, Q8_0, ...; "
                                    "default: Q4_K, MXFP4 for gpt-oss)")
    dense_type: str = Field("Q8_0", description="block type of the dense matrices")
    layers: int | None = Field(None, ge=1, description="fewer layers than the preset (same widths)")
    mtp_layers: int = Field(0, ge=0, description="multi-token-prediction (nextn) blocks after the layers, "
                            "for --spec mtp (qwen3-next presets)")
    context: int | None = Field(None, ge=16, description="the context length the file declares (default: the "
                                "preset's), e.g. 262144 for a 256K-token session of qwen3-30b-a3b's shapes")
    copy_prompt: bool = Field(False, alias="copy", description="a model whose greedy output copies its prompt "
                              "(an induction circuit in layers 0-1, the others adding nothing): a stand-in for a "
                              "real model's tendency to repeat its prompt, for --spec ngram benchmarks; same "
                              "shapes, bytes and speed as the random preset (qwen3moe presets)")
    seed: int = Field(0, description="random seed")

    def cli_cmd(self) -> None:
        """Stream the file to disk and print its size and speed."""
        import time

        from strata_core.tools.synthetic import write_synthetic

        if not Path(self.out).parent.is_dir():
            raise ConfigError(f"{self.out}: no directory {Path(self.out).parent} to write the model in")
        start = time.perf_counter()
        expert_type = None if self.expert_type is None else _qtype(self.expert_type, "--expert-type")
        try:
            size = write_synthetic(self.out, self.preset, expert_type=expert_type,
                                   dense_type=_qtype(self.dense_type, "--dense-type"), n_layers=self.layers,
                                   seed=self.seed, mtp_layers=self.mtp_layers, context=self.context,
                                   copy=self.copy_prompt)
        except OSError as error:  # no such directory, no space, no permission: one line, exit 2
            raise ConfigError(f"{self.out}: cannot write the model: {error.strerror or error}") from None
        seconds = time.perf_counter() - start
        print(f"{self.out}: {size / 2**30:.2f} GiB in {seconds:.1f} s ({size / seconds / 1e6:.0f} MB/s)")
