"""`strata profile` writes a usage profile; `--expert-profile` fills the cache in its rank order."""

from __future__ import annotations

from strata_core.cli import main
from strata_core.engine import Engine
from strata_core.experts.profile import UsageProfile


def test_profile_then_fill_the_cache_from_it(tiny_model_factory, tmp_path, capsys):
    model = tiny_model_factory(expert_type="Q8_0")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The engine loaded the model\n\nEvery token was routed to a few experts\n")
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", str(model), "--prompts", str(prompts), "--out", str(out),
                 "--decode-tokens", "2"]) == 0
    assert "profile of 2 prompts" in capsys.readouterr().out

    engine = Engine.load(model)
    profile = UsageProfile.load(out, engine.spec.n_layers, engine.spec.n_experts)
    assert profile.tokens > 0 and int(profile.counts.sum()) > 0
    top = profile.rank(only_used=True)[:5]

    cached = Engine.load(model, expert_profile=out, expert_cache=5)
    (table,) = cached.experts.tables.values()
    assert sorted(table.resident()) == sorted(top)


def test_profile_without_prompts_is_an_error(tiny_model_factory, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert main(["profile", "--model", str(tiny_model_factory()), "--prompts", str(empty)]) == 2
    assert "no prompts" in capsys.readouterr().err
