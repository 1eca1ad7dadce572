"""Expert residency: the host arena, device caches, residency tables, usage profile, streaming."""

# The ops package first: its MoE ops import experts.cpu_ffn, whose imports need the ops package loaded
# (importing an experts module before strata_core.ops would otherwise meet a half-initialised module).
import strata_core.ops  # noqa: E402,F401
