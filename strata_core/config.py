"""StrataSettings: every option of the engine, the CLI and the server in one place.

Each field is, at once,

* a CLI flag in kebab case (``expert_cache_gib`` -> ``--expert-cache-gib``),
* an environment variable with the ``STRATA_`` prefix (``STRATA_EXPERT_CACHE_GIB``),
* a key of an optional TOML file (``expert_cache_gib = 4``), read from the path in
  ``STRATA_CONFIG`` or, when that is unset, from ``./strata.toml`` if it exists,
* a keyword of ``Engine.load`` (``Engine.load(path, expert_cache=0)``).

Precedence, highest first: CLI flags and ``Engine.load`` keywords, environment variables, the TOML
file, the defaults below. Invalid values are rejected by pydantic with the option's name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from strata_core.errors import ConfigError

CONFIG_FILE_ENV = "STRATA_CONFIG"
DEFAULT_CONFIG_FILE = Path("strata.toml")
DEMO_MODEL = Path(__file__).parent / "data" / "demo-qwen3moe-q8_0.gguf"


def config_file_path() -> Path | None:
    """The TOML settings file in effect: ``$STRATA_CONFIG``, else ``./strata.toml`` if present."""
    named = os.environ.get(CONFIG_FILE_ENV)
    if named:
        if not Path(named).is_file():
            raise ConfigError(f"settings file {named} (from {CONFIG_FILE_ENV} / --config) does not exist")
        return Path(named)
    return DEFAULT_CONFIG_FILE if DEFAULT_CONFIG_FILE.is_file() else None


class TomlFile(TomlConfigSettingsSource):
    """The settings file, as one command sees it: only the keys the settings class has.

    One file serves every command, so a key another command uses (``max_tokens`` of ``generate``)
    is not an error for this one; the CLI rejects keys no command knows. A file that is not valid
    TOML is a ConfigError naming it.
    """

    def __init__(self, settings_cls: type[BaseSettings], toml_file: Path) -> None:
        self._fields = set(settings_cls.model_fields)
        super().__init__(settings_cls, toml_file=toml_file)

    def _read_file(self, file_path: Path) -> dict[str, Any]:  # type: ignore[override]
        try:
            data = super()._read_file(file_path)
        except (OSError, ValueError) as error:  # tomllib.TOMLDecodeError is a ValueError
            raise ConfigError(f"settings file {file_path}: {error}") from None
        return {key: value for key, value in data.items() if key in self._fields}


class StrataSettings(BaseSettings):
    """All Strata options (engine, residency, server, observers)."""

    model_config = SettingsConfigDict(
        env_prefix="STRATA_",
        extra="forbid",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_avoid_json=True,
        validate_default=True,
    )

    # --- model and topology -------------------------------------------------------------------
    model: Path = Field(DEMO_MODEL, description="GGUF model file, or the first part of a split one ("
                        "default: the embedded demo model)")
    strategy: str = Field("single", description="topology strategy (see `strata plugins`)")
    strategy_options: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="options of the selected strategy, validated by its model"
    )
    devices: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["cpu"],
        description="devices in order, e.g. cuda:0,cuda:1 or logical devices cpu,cpu",
    )
    nnodes: int = Field(1, ge=1, description="ranks of a multi-process engine, one a node (SGLang's flag; under "
                        "torchrun its WORLD_SIZE)")
    node_rank: int = Field(0, ge=0, description="this process's rank: 0 serves, the others compute their "
                           "--devices entries rankN:DEVICE")
    dist_init_addr: str | None = Field(None, description="HOST:PORT where the ranks meet (rank 0 listens there)")
    dist_timeout: float = Field(300.0, gt=0, description="seconds a rank may take to answer (its share of one "
                                "prompt chunk) before it is reported failed")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="compute dtype of activations (auto: float32 on CPU, bfloat16 on CUDA)"
    )
    max_context: int = Field(4096, ge=16, description="tokens of KV cache per session, capped by the model")
    kv_block: int = Field(16, ge=1, description="tokens per block of the paged KV cache (prefixes are shared in "
                          "whole blocks)")
    kv_pool_tokens: int | None = Field(
        None, ge=1, description="tokens of paged KV per device slot, every session's blocks together (default: "
        "--parallel x --max-context); at least --max-context")
    kv_type: Literal["auto", "bf16", "q8_0", "int8", "fp8"] = Field(
        "auto", description="how the KV cache stores its rows: auto (the compute dtype), bf16, or quantized with "
        "scales and dequantized by the attention a block of keys at a time: q8_0 (int8, a scale per 32 values), "
        "int8 (a scale per kv head and token), fp8 (e4m3, a scale per kv head and token); the quantized types "
        "take about half the bytes of bf16")

    # --- expert residency ----------------------------------------------------------------------
    arena: Literal["mmap", "pinned"] = Field("mmap", description="host copy of the expert weights")
    pin_limit_gib: float | None = Field(None, ge=0, description="cap on pinned arena memory (GiB)")
    expert_cache: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="device expert-cache slots per device, or auto"
    )
    expert_cache_gib: float | None = Field(None, ge=0, description="device expert-cache size in GiB")
    expert_cache_fill_all: bool = Field(False, description="fill the whole budget past the profile")
    reserve_mib: int = Field(512, ge=0, description="device memory left free by auto sizing (MiB)")
    vram_budget_gib: float | None = Field(
        None, gt=0, description="memory the engine may use on each device, in GiB: dense weights, KV, buffers and "
        "the expert cache together (a 24 GiB card on a larger one; default: what the device has free)")
    expert_profile: Path | None = Field(None, description="JSON usage profile ranking the experts")
    prefill_chunk: int = Field(8192, ge=1, description="prompt tokens per prefill chunk")
    pcie_frac: Annotated[float, Field(ge=0, le=1)] | Literal["auto"] = Field(
        "auto", description="share of decode misses read over the host link, the rest computed on the CPU; auto: "
        "1 where every expert is resident or the CPU kernels do not cover the experts' formats, 0 where every "
        "device is the CPU, else per layer the split that balances the link and the CPU, measured in the first "
        "decode windows (a split below 1 turns the decode gather and CUDA graphs off); on a GPU a prompt chunk "
        "shorter than a threshold measured at load splits its misses the same way, a longer one streams them"
    )
    adapt_swaps: int = Field(0, ge=0, description="experts swapped into the cache per decode window")

    # --- decode --------------------------------------------------------------------------------
    cuda_graphs: bool = Field(
        True, description="capture decode windows as CUDA graphs (the whole step where one device runs it, else "
        "one per device slot and layer range) where they apply: CUDA, --arena pinned, --pcie-frac 1 (or auto "
        "resolved to 1), no --adapt-swaps; and prompt passes of new sessions, per token bucket up to 4096, where "
        "one device holds every expert (bf16/fp16, float KV, compute capability 9.0+); else eager, said once in the log"
    )
    batch_invariant: bool = Field(
        False, description="greedy output identical whatever the batch a request decodes in (alone or beside "
        "others, with or without speculation): a row's logits do not depend on the other rows of its window. On "
        "CUDA the dense products take cuBLAS's 64-row kernel for every window of up to 64 rows, attention a "
        "fixed split (gpt-oss, deepseek2, qwen3next: row by row over the whole KV capacity), the MoE its "
        "per-pair kernels (one session pays most: its products read the bf16 copies, not the Q8_0 ones); "
        "the CPU is batch-invariant always"
    )
    dense_q8: bool = Field(
        True, description="decode's fused layers read repacked Q8_0 copies of the Q8_0 dense products (CUDA; "
        "built at load, counted with the dense part)"
    )

    # --- kernel choices (CUDA; each off: the torch form it replaces, for comparison) ---------------
    fused_norms: bool = Field(
        True, description="RMSNorm and the q/k norm + RoPE as fused Triton kernels (off: the torch formulas)"
    )
    device_sdpa: bool = Field(
        True, description="attention through torch SDPA (flash / cuDNN / memory-efficient kernels; off: the "
        "CPU's masked matmul over the cache)"
    )
    mla_kernel: bool = Field(
        True, description="MLA decode attention (deepseek2) through the flash-decoding kernel reading the latent "
        "cache in place (off: its torch form)"
    )
    deltanet_chunked: Literal["fla", "torch", "recurrent"] = Field(
        "fla", description="Gated DeltaNet prompts (qwen3next): fla-core's chunked kernel where it is installed, "
        "the torch chunked form, or token by token"
    )
    fused_expert_ffn: bool = Field(
        True, description="decode's fused expert kernels also compute biased / swiglu_oai experts (gpt-oss; off: "
        "a dequantize and a grouped product per layer)"
    )
    miss_read: Literal["staged", "direct"] = Field(
        "staged", description="decode kernels read a miss in the pinned arena from a device row copied first "
        "(staged) or zero-copy over the host link (direct)"
    )
    moe_config: str = Field("", description="launch fields of the CUDA MoE kernels, name=value,... (e.g. "
                            "design=split: batched windows on the per-pair kernels too); default: the measured "
                            "defaults (ops/moe.py LaunchConfig)")

    # --- server --------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="address the server binds")
    port: int = Field(8080, ge=0, le=65535, description="port the server listens on")
    parallel: int = Field(4, ge=1, description="concurrent generation slots")
    step_tokens: int = Field(
        8192, gt=0, description="tokens one scheduler step computes: one for every slot that is generating, the "
        "rest for prompt chunks of the requests starting, oldest first, in one pass. A long prompt delays the "
        "running streams by one step of this size at most (smaller: steadier streams; larger: faster prompts, "
        "since every prompt pass costs a near-fixed time however few its tokens, and fewer passes over experts "
        "streamed from host RAM); a step in which no slot generates takes up to --prefill-chunk. At least --parallel"
    )
    overlap_windows: bool = Field(
        True, description="enqueue each decode window before the tokens of the one before reach the host (they "
        "feed it on the device), so the host's work between windows runs beside the device's; off: every "
        "window waits for its tokens first"
    )
    spec: Literal["off", "ngram", "mtp"] = Field(
        "off", description="speculative decoding (off, ngram or mtp): ngram drafts a request's next tokens from "
        "its own (prompt lookup), mtp with the model's multi-token-prediction block (a GGUF with nextn layers); "
        "either verifies them in its decode window, the same text in fewer windows"
    )
    spec_tokens: int = Field(4, ge=1, description="tokens drafted a window with --spec ngram or mtp")
    spec_min_p: float = Field(
        0.0, ge=0, le=1, description="with --spec mtp, the MTP block stops drafting a window at a token it gives "
        "less than this probability (0: always --spec-tokens drafts); a draft unlikely to be kept costs a row")
    max_queue: int = Field(64, ge=0, description="requests waiting beyond the slots before 503")
    conv_cache: int = Field(4, ge=0, description="displaced conversations of a model with recurrent state kept in "
                            "host RAM (other models keep their KV blocks cached on the device)")
    conv_cache_gib: float = Field(4.0, ge=0, description="host RAM for the conversation cache (GiB)")
    api_key: SecretStr | None = Field(None, description="require `Authorization: Bearer KEY` "
                                      "(or `X-Api-Key: KEY`)")
    model_alias: str | None = Field(None, description="model name served at /v1/models")
    max_body_mib: float = Field(8.0, gt=0, description="largest request body the server reads (MiB); larger is 413")
    threads: int | None = Field(None, ge=1, description="CPU threads of torch's compute pool, set once at start on "
                                "the one thread that runs every model call (default: torch's, one per core)")
    header_timeout: float = Field(10.0, gt=0, description="seconds a client has to send a request's head (from its "
                                  "first byte, or from connecting); then 408 and the connection is closed")
    body_timeout: float = Field(30.0, gt=0, description="seconds a client has to send a request's body after its "
                                "head; then 408 and the connection is closed")
    max_connections: int = Field(512, ge=1, description="open connections the server keeps; one more is answered "
                                 "503 and closed")
    shutdown_grace: float = Field(10.0, ge=0, description="seconds running requests get to finish on SIGTERM before "
                                  "each is ended with an error (streams: an error event and [DONE])")
    template_timeout: float = Field(5.0, gt=0, description="seconds the chat template may take to render one "
                                    "request; then it is stopped and the request gets a 500 naming it")
    template_max_mib: float = Field(16.0, gt=0, description="largest prompt the chat template may produce (MiB of "
                                    "characters); more stops it (500)")
    webui: bool = Field(True, description="serve the chat page at / (--no-webui: / is 404)")
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Host header values the server answers besides the address it binds "
        "(comma-separated; *.example.com matches subdomains; * turns the check off)")
    strict_requests: bool = Field(False, description="reject unknown request fields with a 400 naming the field "
                                  "(default: accept them, each name logged once)")
    strict_model: bool = Field(False, description="answer 404 to a request naming a model other than the served "
                               "one (default: any name gets the served model, each name logged once; a request "
                               "may name none)")
    n_predict: int = Field(-1, ge=-1, description="default max_tokens when a request sets none; -1 (or 0): until "
                           "the context is full (text completions: OpenAI's 16)")
    reasoning: Literal["auto", "on", "off"] = Field(
        "auto", description="thinking of a chat template that reads enable_thinking: off renders requests with it "
        "false, as llama-server's --reasoning off (a request's reasoning_effort or chat_template_kwargs still "
        "decide for it); auto and on: true")
    seed: int | None = Field(None, ge=0, lt=2**64, description="sampling seed of every request that sets none, as "
                             "llama-server's --seed (default: a fresh random seed each request)")
    grammar_file: Path | None = Field(None, description="GBNF grammar the output of every request follows unless "
                                      "it asks for its own grammar, schema or tool call")
    json_schema: str | None = Field(None, description="JSON schema (its text) the output of every request follows "
                                    "unless it asks for its own grammar, schema or tool call")
    cors: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="origins whose web pages may call the API (CORS; comma-separated; * any "
        "origin; localhost any origin on this machine, any port); default none: no CORS headers")

    # --- observers and plugins -------------------------------------------------------------------
    prefill_timing: bool = Field(False, description="print host/device time per prefill chunk")
    decode_timing: bool = Field(False, description="print host/device time per decode window")
    dbg_nan: bool = Field(False, description="check every layer's output for non-finite values")
    dbg_handoff: bool = Field(False, description="read each hand-off's destination back and compare it")
    plugins: Annotated[list[str] | None, NoDecode] = Field(None, description="allow-list of plugin distributions")
    disable_plugin_autoload: bool = Field(False, description="load no entry-point plugins")

    @field_validator("devices", "plugins", "allowed_hosts", "cors", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("moe_config")
    @classmethod
    def _moe_config_is_valid(cls, value: str) -> str:
        from strata_core.ops.moe import parse_launch

        parse_launch(value)  # a ValueError names the field or value
        return value

    @field_validator("grammar_file", "json_schema")
    @classmethod
    def _grammar_is_valid(cls, value: Any, info: ValidationInfo) -> Any:
        from strata_core.serving.grammar import server_grammar  # llguidance is loaded only where it is used

        if value is None:
            return value
        if info.field_name == "json_schema":
            if info.data.get("grammar_file") is not None:
                raise ValueError("set --json-schema or --grammar-file, not both")
            server_grammar(None, value)
        else:
            server_grammar(value, None)
        return value

    @field_validator("step_tokens")
    @classmethod
    def _step_holds_every_slot(cls, value: int, info: ValidationInfo) -> int:
        parallel = info.data.get("parallel", 1)
        if value < parallel:
            raise ValueError(f"--step-tokens {value} is less than --parallel {parallel}: a step must hold a decode "
                             "token for every slot and leave room for a prompt chunk")
        return value

    @field_validator("spec_min_p")
    @classmethod
    def _min_p_needs_mtp(cls, value: float, info: ValidationInfo) -> float:
        spec = info.data.get("spec", "off")
        if value > 0 and spec != "mtp":
            raise ValueError(f"--spec-min-p applies to --spec mtp (the MTP block's probabilities); --spec {spec} "
                             "drafts have none")
        return value

    @field_validator("node_rank")
    @classmethod
    def _rank_below_nnodes(cls, value: int, info: ValidationInfo) -> int:
        nnodes = info.data.get("nnodes", 1)
        if value >= nnodes:
            raise ValueError(f"--node-rank {value} is not below --nnodes {nnodes}")
        return value

    @field_validator("devices")
    @classmethod
    def _devices_not_empty(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one device is needed")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Init kwargs / CLI, then ``STRATA_*`` env, then the TOML file."""
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = config_file_path()
        if path is not None:
            sources.append(TomlFile(settings_cls, toml_file=path))
        return tuple(sources)
