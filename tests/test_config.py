"""Config: keys, types, files, overrides, and the messages bad input gets."""

import dataclasses

import pytest

from moeflow.cli import main as cli_main
from moeflow.config import JobConfig, all_keys, field_docs, load_config, load_run_config, parse_overrides, to_toml


def test_every_setting_has_a_docstring():
    missing = [k for k, (_, doc) in all_keys().items() if not doc]
    assert missing == []


def test_toml_then_overrides_take_precedence(tmp_path):
    f = tmp_path / "job.toml"
    f.write_text('[model]\nname = "tiny-dense"\n[training]\nsteps = 7\nlr = 0.5\n')
    cfg = load_config(f, parse_overrides(["--training.lr=0.25", "--model.dim", "64"]))
    assert cfg.model.name == "tiny-dense" and cfg.model.moe.num_experts == 0
    assert (cfg.training.steps, cfg.training.lr, cfg.model.dim) == (7, 0.25, 64)


def test_printed_config_loads_back_to_the_same_config(tmp_path):
    cfg = load_config(None, parse_overrides(["--model.moe.capacity_factor=1.25", "--training.dtype=bf16"]))
    f = tmp_path / "printed.toml"
    f.write_text(to_toml(cfg))
    assert dataclasses.asdict(load_config(f)) == dataclasses.asdict(cfg)


def test_booleans_and_optional_values():
    cfg = load_config(None, parse_overrides(["--metrics.tensorboard=false", "--model.moe.capacity_factor=none"]))
    assert cfg.metrics.tensorboard is False and cfg.model.moe.capacity_factor is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.stepz=3"], r"unknown config key 'training.stepz'\. Did you mean 'training.steps'\?"),
        (["--modle.dim=3"], r"unknown config key 'modle.dim'\. Did you mean 'model.dim'\?"),
        (["--training.steps=ten"], r"training.steps expects int, got 'ten'"),
        (["--training.lr=fast"], r"training.lr expects float, got 'fast'"),
        (["--model.moe.top_k=9"], r"model.moe.top_k \(9\) must be between 1 and model.moe.num_experts \(8\)"),
        (["--model.n_heads=3"], r"model.n_heads \(3\) must divide model.dim \(128\)"),
        (["--model.n_kv_heads=3"], r"model.n_kv_heads \(3\) must divide model.n_heads \(4\)"),
        (["--model.moe.n_group=3"], r"model.moe.num_experts \(8\) must split into model.moe.n_group \(3\)"),
        (["--model.moe.n_group=2", "--model.moe.topk_group=4"],
         r"model.moe.topk_group \(4\) must be between 1 and model.moe.n_group \(2\)"),
        (["--model.name=tiny-mo"], r"model.name = 'tiny-mo' is not a preset\. Did you mean 'tiny-moe'\?"),
        (["--training.dtype=fp16"], r"training.dtype = 'fp16' is not one of \['fp32', 'bf16'\]"),
        (["--data.seq_len=5000"], r"data.seq_len \(5000\) exceeds model.max_seq_len \(4096\)"),
        (["--training.activation_checkpointing=some"], r"training.activation_checkpointing = 'some'"),
        (["training.steps=3"], r"settings look like --section.key=value"),
        (["--verbose"], r"--verbose needs a value"),
        (["--data.packing=true", "--parallel.cp=2"], r"data.packing = true with parallel.cp = 2.*data.packing = false"),
        (["--data.packing=true", "--model.mtp_depth=1"], r"data.packing = true with model.mtp_depth = 1"),
        (["--training.fp8=tensorwise", "--data.seq_len=48", "--parallel.cp=2"],
         r"data.seq_len \(48\) must be a multiple of 16 x parallel.cp \(2\) = 32"),
        (["--parallel.ep_num_worst_tokens=64"], r"parallel.ep_num_worst_tokens = 64; use 0 .* or -1"),
        (["--model.moe.expert_impl=grouped_mm", "--model.moe.ffn_dim=12", "--training.dtype=bf16"],
         r"expert_impl = 'grouped_mm' needs rows of a multiple of 16 bytes: .*ffn_dim 12 in bf16.*'auto'"),
        (["--parallel.ep_overlap=maybe"], r"parallel.ep_overlap expects bool or NoneType, got 'maybe'"),
    ],
)
def test_bad_settings_name_the_key_the_value_and_a_fix(args, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, parse_overrides(args))


def test_missing_and_invalid_config_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps = 1\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(bad)


def test_field_docs_reads_the_string_under_each_field():
    assert field_docs(JobConfig)["run_dir"].startswith("Where metrics")


def _run_dir(tmp_path, *args):
    """A run directory as the trainer leaves it: config.toml holding the effective config."""
    cfg = load_config(None, parse_overrides([*args, f"--run_dir={tmp_path}"]))
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    return cfg


def test_a_run_directory_config_is_the_starting_point(tmp_path, capsys):
    saved = _run_dir(tmp_path, "--model.name=tiny-dense", "--model.dim=32", "--model.n_heads=2", "--training.lr=0.5")
    assert load_run_config(tmp_path / "elsewhere") is None
    cfg = load_run_config(tmp_path, parse_overrides(["--training.lr=0.25", "--model.dim=32", "--model.n_kv_heads=2",
                                                     "--model.rope_theta=500000"]))
    # how to train (and settings equal to the saved shape, or the same shape spelled out) apply
    assert (cfg.model.name, cfg.model.dim, cfg.model.n_heads, cfg.training.lr) == ("tiny-dense", 32, 2, 0.25)
    assert cfg.model.rope_theta == 500000 and cfg.model.shape_settings() == saved.model.shape_settings()
    # the command line: --run-dir alone gives the saved model, not the default preset
    assert cli_main(["train", "--run-dir", str(tmp_path), "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert 'name = "tiny-dense"' in printed and "dim = 32" in printed


@pytest.mark.parametrize("args, message", [
    (["--model.dim=64"], r"--model.dim=64 changes the model of the run in .* \(model.dim = 32 in .*config.toml, 64"),
    (["--model.n_heads=4"], r"--model.n_heads=4 changes .*model.n_heads = 2"),
    (["--model.moe.num_experts=8"], r"--model.moe.num_experts=8 changes .*model.moe.num_experts = 4"),
    (["--model.name=tiny-dense"], r"--model.name=tiny-dense changes .*model.name = 'tiny-moe'"),
    (["--model.vocab_size=512", "--training.lr=1"], r"--model.vocab_size=512 changes .*another --run-dir"),
])
def test_an_override_that_changes_a_run_directory_model_is_refused(tmp_path, capsys, args, message):
    _run_dir(tmp_path, "--model.dim=32", "--model.n_heads=2", "--model.moe.num_experts=4")
    with pytest.raises(ValueError, match=message):
        load_run_config(tmp_path, parse_overrides(args))
    assert cli_main(["train", "--run-dir", str(tmp_path), *args, "--print-config"]) == 2
    assert "changes the model of the run" in capsys.readouterr().err
    # --fresh ignores the checkpoints, so it may start the directory over with another model
    assert cli_main(["train", "--run-dir", str(tmp_path), *args, "--fresh", "--print-config"]) == 0
    printed = capsys.readouterr().out
    leaf, value = args[0][2:].rsplit(".", 1)[1].split("=")
    assert f"\n{leaf} = {value}\n" in printed or f'\n{leaf} = "{value}"\n' in printed


def test_wandb_without_the_package_is_refused_before_any_process(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"metrics.wandb = true needs the wandb package: pip install"):
        load_config(None, parse_overrides(["--metrics.wandb=true"]))


def test_every_registered_choice_is_a_setting_checked_and_listed():
    """moeflow/core/choices.py is the one list of each setting's values: every entry names a real setting, a value
    outside it is refused naming the setting, and --help-config lists the values."""
    from moeflow.cli import _help_config
    from moeflow.core.choices import SETTINGS

    keys, help_text = all_keys(), _help_config()
    for setting, choices in SETTINGS.items():
        assert setting in keys, setting
        assert f"one of: {', '.join(choices)}" in help_text, setting
        with pytest.raises(ValueError, match=setting.replace(".", r"\.")):
            load_config(None, {setting: "not-a-choice"}).layout(1)


def test_every_registered_ep_transport_has_a_backend():
    from moeflow.core.choices import EP_TRANSPORTS
    from moeflow.ep.backends import BACKENDS

    assert tuple(BACKENDS) == EP_TRANSPORTS
