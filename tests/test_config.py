"""StrataSettings: CLI flags, STRATA_* variables, TOML keys, precedence, validation messages."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from pydantic_settings import CliApp

from strata_core.config import StrataSettings


def test_env_overrides_toml_and_kwargs_override_env(tmp_path, monkeypatch):
    config = tmp_path / "strata.toml"
    config.write_text('prefill_chunk = 111\nreserve_mib = 7\nport = 9001\n')
    monkeypatch.setenv("STRATA_CONFIG", str(config))
    monkeypatch.setenv("STRATA_PREFILL_CHUNK", "222")
    settings = StrataSettings(port=9002)
    assert settings.prefill_chunk == 222  # env beats TOML
    assert settings.reserve_mib == 7  # TOML beats default
    assert settings.port == 9002  # keyword beats TOML


def test_cli_flag_beats_env(monkeypatch):
    monkeypatch.setenv("STRATA_PREFILL_CHUNK", "222")
    settings = CliApp.run(StrataSettings, cli_args=["--prefill-chunk", "333", "--devices", "cpu,cpu", "--dbg-nan"])
    assert settings.prefill_chunk == 333
    assert settings.devices == ["cpu", "cpu"]
    assert settings.dbg_nan is True


def test_env_list_and_bool(monkeypatch):
    monkeypatch.setenv("STRATA_DEVICES", "cpu,cpu")
    monkeypatch.setenv("STRATA_DBG_NAN", "1")
    settings = StrataSettings()
    assert settings.devices == ["cpu", "cpu"] and settings.dbg_nan


@pytest.mark.parametrize(
    ("field", "value"),
    [("pcie_frac", 1.5), ("prefill_chunk", 0), ("arena", "disk"), ("expert_cache", "lots"), ("port", 70000),
     ("step_tokens", 0)],
)
def test_invalid_values_name_the_option(field, value):
    with pytest.raises(ValidationError) as info:
        StrataSettings(**{field: value})
    assert field in str(info.value)


def test_pcie_frac_is_auto_by_default_and_takes_a_share(monkeypatch):
    monkeypatch.delenv("STRATA_PCIE_FRAC", raising=False)  # the test plugin fixes it for the session
    assert StrataSettings().pcie_frac == "auto"
    assert StrataSettings(pcie_frac=0.25).pcie_frac == 0.25
    monkeypatch.setenv("STRATA_PCIE_FRAC", "0.5")
    assert StrataSettings().pcie_frac == 0.5
    with pytest.raises(ValidationError, match="pcie_frac"):
        StrataSettings(pcie_frac="half")


def test_a_step_holds_a_decode_token_for_every_slot():
    assert StrataSettings(parallel=8, step_tokens=8).step_tokens == 8
    with pytest.raises(ValidationError, match="--step-tokens 4 is less than --parallel 8"):
        StrataSettings(parallel=8, step_tokens=4)


def test_a_command_s_settings_class_keeps_the_validators():
    from strata_core.cli.settings import ENGINE, SERVER, settings_with

    command = settings_with(ENGINE, SERVER)
    assert command(devices="cpu,cpu").devices == ["cpu", "cpu"]
    with pytest.raises(ValidationError, match="less than --parallel 8"):
        command(parallel=8, step_tokens=4)


def test_unknown_option_is_rejected():
    with pytest.raises(ValidationError, match="expert_cash"):
        StrataSettings(expert_cash=3)


def test_missing_config_file_is_named(monkeypatch, tmp_path):
    from strata_core.errors import ConfigError

    monkeypatch.setenv("STRATA_CONFIG", str(tmp_path / "absent.toml"))
    with pytest.raises(ConfigError, match="absent.toml"):
        StrataSettings()


@pytest.mark.parametrize("spec, message", [("nope=1", "'nope' is not a field"), ("bm=8", "below 16"),
                                           ("grouped=maybe", "not true or false"), ("bm=x", "not an integer"),
                                           ("dot_precision=fp4", "dot_precision")])
def test_moe_config_names_what_it_cannot_take(spec, message):
    with pytest.raises(ValidationError, match=message):
        StrataSettings(moe_config=spec)


def test_moe_config_becomes_the_kernels_default_launch(tiny_model_factory, monkeypatch):
    import dataclasses

    from strata_core.engine import Engine
    from strata_core.ops import moe

    monkeypatch.setattr(moe, "_launch", [moe.DEFAULT_LAUNCH])  # the process's default, put back after the test
    Engine.load(tiny_model_factory(expert_type="Q4_0", n_layers=2), devices=["cpu"], max_context=32,
                moe_config="grouped=true, dot_precision=bf16,bm=32")
    assert moe.launch_config() == dataclasses.replace(moe.DEFAULT_LAUNCH, grouped=True, dot_precision="bf16", bm=32)
