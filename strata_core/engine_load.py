"""The steps of loading a model under a strategy (``Engine.from_settings``), up to the parts an engine is made of.

In order: the plugins and the strategy; the cluster where ``--devices`` names other ranks' devices; the GGUF
and its model spec (``--spec mtp`` checked before any weight is read); the strategy's placement; the memory
plan against the budget (dense weights and paged KV per device, a clear error before loading); the dense
weights placed per layer; the expert backend (arena, caches); the tokenizer and chat template. Each step
logs what it decided; ``report`` hears the fraction loaded.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from strata_core.config import StrataSettings
from strata_core.errors import ConfigError
from strata_core.experts.backend import ExpertBackend, build_expert_backend
from strata_core.experts.sizing import check_dense_budget
from strata_core.experts.weights import ExpertWeights
from strata_core.gguf.reader import GGUFFile
from strata_core.model.fused_decode import place_q8_copies
from strata_core.model.head_split import HeadSplit
from strata_core.model.kvpool import KVPools
from strata_core.model.mtp import mtp_block_spec
from strata_core.model.registry import get_architecture, load_model_spec
from strata_core.model.spec import ModelSpec
from strata_core.model.transformer import MoEModel
from strata_core.model.weights import DenseWeights
from strata_core.ops import moe
from strata_core.plugin.manager import SelectedStrategy, StrataPluginManager, build_plugin_manager
from strata_core.plugin.placement import PHASES, DeviceSlot, Placement
from strata_core.plugin.spec import StrategyOptions
from strata_core.remote import Cluster, RemoteStages, launch_of
from strata_core.remote.launch import check_placement
from strata_core.runtime.devices import compute_dtype, resolve_slots, split_rank
from strata_core.runtime.memory_plan import dense_bytes_per_device, kv_bytes_per_device, state_copies
from strata_core.text.chat import ChatTemplate
from strata_core.text.tokenizer import Tokenizer

__all__ = ["EngineParts", "kv_pools", "load_parts", "plan_placement"]

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """What an :class:`~strata_core.engine.Engine` is made of (its constructor's arguments)."""

    settings: StrataSettings
    plugins: StrataPluginManager
    options: StrategyOptions
    gguf_file: GGUFFile
    spec: ModelSpec
    devices: tuple[DeviceSlot, ...]
    placement: Placement
    model: MoEModel
    experts: ExpertBackend
    tokenizer: Tokenizer | None
    chat: ChatTemplate
    pools: KVPools | None = None
    remote: RemoteStages | None = None
    local: frozenset[int] | None = None


def load_parts(settings: StrataSettings, report: Callable[[float], None], cluster: Cluster | None) -> EngineParts:
    """Load the model named by ``settings`` up to an engine's parts (the module doc's steps); ``report``
    hears the fraction loaded (up to 0.99: the engine's own steps finish it); ``cluster``: the ranks
    joined already, if any."""
    plugins = build_plugin_manager(settings)
    selected = plugins.select_strategy(settings.strategy, settings.strategy_options)
    others = any(split_rank(name)[0] for name in settings.devices)  # devices of other ranks: join them
    if cluster is None and others and (launch := launch_of(settings)) is not None:
        cluster = Cluster.join(settings, launch)
    rank = 0 if cluster is None else cluster.rank
    devices = resolve_slots(settings.devices, rank, None if cluster is None else cluster.memory)
    local = frozenset(d.index for d in devices if d.rank == rank)
    gguf_file = GGUFFile.open(settings.model)
    spec = load_model_spec(gguf_file)
    if settings.moe_config:
        moe.set_default_launch(moe.parse_launch(settings.moe_config))
        log.info("MoE kernels: %s", moe.launch_config())
    if settings.spec == "mtp":  # before any weight is read
        mtp_block_spec(settings.model, spec)
    placement = plan_placement(plugins, selected, settings, devices, spec)
    log.info("model %s: %s, %d layers, %d experts (top-%d)", settings.model, spec.architecture,
             spec.n_layers, spec.n_experts, spec.n_experts_used)
    for phase in PHASES:
        log.info("%s placement: %s", phase, "; ".join(
            f"{devices[s.device]} layers {s.layers.start}..{s.layers.stop - 1}" for s in placement.segments(phase)))
    dtype = compute_dtype(settings.dtype, devices[placement.main].device)
    slots = {d.index: d for d in devices if d.index in local}  # this process's: all but across ranks
    pools, dense_bytes = _plan_memory(settings, spec, placement, slots, dtype)
    report(0.02)
    model = _load_model(settings, gguf_file, spec, placement, slots, dtype)
    dense_bytes = place_q8_copies(model, gguf_file, settings, placement, slots, dense_bytes)
    report(0.2)
    experts = build_expert_backend(ExpertWeights(gguf_file, spec), spec, placement, slots, settings, dense_bytes,
                                   progress=lambda fraction: report(0.2 + 0.79 * fraction))
    has_tokenizer = "tokenizer.ggml.tokens" in gguf_file.metadata
    if rank != 0:  # another rank's engine runs segments only: rank 0 tokenizes
        has_tokenizer = False
    elif not has_tokenizer:
        log.warning("%s has no tokenizer: only token ids can be used", settings.model)
    remote = None
    if rank == 0 and cluster is not None:
        remote = RemoteStages(cluster, devices, {phase: placement.segments(phase) for phase in PHASES})
    return EngineParts(settings, plugins, selected.options, gguf_file, spec, devices, placement, model, experts,
                       Tokenizer.from_gguf(gguf_file.metadata) if has_tokenizer else None,
                       ChatTemplate.from_gguf(gguf_file.metadata), pools, remote, local)


def _plan_memory(settings: StrataSettings, spec: ModelSpec, placement: Placement, slots: dict[int, DeviceSlot],
                 dtype: torch.dtype) -> tuple[KVPools, dict[torch.device, int]]:
    """The paged-KV pools and the dense bytes each of ``slots``' devices will hold, checked against the budget
    before anything loads (``check_dense_budget``: a BudgetError naming what does not fit)."""
    pools = kv_pools(settings, spec, dtype)
    kv_tokens = pools.n_blocks * pools.block_size  # the null and padding blocks' too
    plan = (spec, placement, slots, dtype, kv_tokens, settings.kv_type,
            state_copies(settings.parallel, settings.cuda_graphs))
    dense_bytes = dense_bytes_per_device(*plan)
    check_dense_budget(settings, dense_bytes, kv_bytes_per_device(*plan), pools.session_tokens)
    return pools, dense_bytes


def _load_model(settings: StrataSettings, gguf_file: GGUFFile, spec: ModelSpec, placement: Placement,
                slots: dict[int, DeviceSlot], dtype: torch.dtype) -> MoEModel:
    """The architecture's forward over the dense weights of the layers ``slots`` compute, each on the devices
    of the phases placing it there (the embedding and head on the main device, where it is this process's)."""
    layer_devices: dict[int, set[torch.device]] = {}
    for phase in PHASES:
        for layer, placed in enumerate(placement.layers(phase)):
            if placed.device in slots:
                layer_devices.setdefault(layer, set()).add(slots[placed.device].device)
    head = placement.main in slots  # the embedding and head: rank 0's
    dense = DenseWeights.load(gguf_file, spec, dtype, layers=set(layer_devices), with_globals=head).place(
        layer_devices, slots[placement.main].device if head else torch.device("cpu"))
    model = get_architecture(spec.architecture).model(spec, dense, settings)
    if settings.kv_type == "bf16" and dtype == torch.bfloat16:  # the rows are the compute dtype's: as auto
        model.kernels = dataclasses.replace(model.kernels, kv_type="auto")
    if model.splits_heads and spec.n_kv_heads >= 2:
        model.head_splits = _head_splits(placement, slots, spec)
    elif any(placed.attention_peer is not None for placed in placement.layers("prompt")):
        log.info("prompt attention: every head on the layer's device (%s attention with %s kv heads is not "
                 "split)", spec.architecture, getattr(spec, "n_kv_heads", "its own"))
    return model


def _head_splits(placement: Placement, slots: dict[int, DeviceSlot], spec: ModelSpec) -> dict[int, HeadSplit]:
    """Per prompt layer whose placement names an attention peer, the split of its heads with that peer
    (one ``HeadSplit`` per pair of devices): the peer takes half of the kv heads."""
    splits: dict[tuple[int, int], HeadSplit] = {}
    by_layer = {}
    for layer, placed in enumerate(placement.layers("prompt")):
        if placed.attention_peer is None or placed.device not in slots:
            continue
        pair = (placed.device, placed.attention_peer)
        if pair not in splits:
            splits[pair] = HeadSplit(slots[pair[0]].device, slots[pair[1]].device, spec.n_kv_heads // 2)
            log.info("prompt attention: %d of %d kv heads of %s's layers on %s", spec.n_kv_heads // 2,
                     spec.n_kv_heads, slots[pair[0]], slots[pair[1]])
        by_layer[layer] = splits[pair]
    return by_layer


def kv_pools(settings: StrataSettings, spec: ModelSpec, dtype: torch.dtype) -> KVPools:
    """The engine's paged-KV pools, sized by ``--kv-block`` and ``--kv-pool-tokens`` (default
    ``--parallel x`` the context); BudgetError when a pool cannot hold one session. Nothing is
    allocated yet (``Engine`` gives each device slot's pool its layers)."""
    max_context = min(settings.max_context, spec.context_length)
    tokens = settings.kv_pool_tokens or settings.parallel * max_context
    return KVPools.for_tokens(tokens, settings.kv_block, dtype, max_context, settings.kv_type)



def plan_placement(plugins: StrataPluginManager, selected: SelectedStrategy, settings: StrataSettings,
                   devices: Sequence[DeviceSlot], spec: ModelSpec) -> Placement:
    """The placement ``selected`` gives on ``devices`` for ``spec``, validated, and checked to run across
    ranks where a device slot is another rank's (ConfigError naming what cannot)."""
    placement = plugins.hook.strata_topology(devices=list(devices), spec=spec, settings=settings,
                                             options=selected.options)
    if placement is None:
        raise ConfigError(f"strategy {selected.spec.name!r} returned no placement")
    placement.validate(spec.n_layers, len(devices))
    if any(slot.rank for slot in devices):
        check_placement(placement, tuple(devices))
    return placement
