"""Loading: YAML composition with extends, overrides, error collection with file and line."""
import pytest
from omegaconf import OmegaConf

from megarl.config import ConfigError, load_config, save_resolved
from megarl.config.schema import MegarlConfig


def write(path, text):
    path.write_text(text)
    return path


def test_defaults_are_the_gspo_paper_values():
    cfg = load_config(None)
    assert cfg.algorithm.policy_loss == "gspo"
    assert (cfg.algorithm.clip_low, cfg.algorithm.clip_high) == (3e-4, 4e-4)
    assert cfg.algorithm.kl_coef == 0.0
    assert OmegaConf.get_type(cfg) is MegarlConfig


def test_extends_chain_and_overrides(tmp_path):
    write(tmp_path / "base.yaml", "train:\n  lr: 1.0e-5\n  num_steps: 3\nrollout:\n  group_size: 4\n")
    write(tmp_path / "mid.yaml", "extends: base.yaml\ntrain:\n  num_steps: 7\n")
    leaf = write(tmp_path / "leaf.yaml", "extends: [mid.yaml]\nrollout:\n  tools:\n    python: {timeout_s: 2}\n")
    cfg = load_config(leaf, ["train.lr=2e-6", "rollout.tools.calculator={}"])
    assert cfg.train.num_steps == 7 and cfg.train.lr == 2e-6 and cfg.rollout.group_size == 4
    assert set(cfg.rollout.tools) == {"python", "calculator"}


def test_errors_collected_with_file_and_line(tmp_path):
    bad = write(tmp_path / "bad.yaml", "train:\n  lr: fast\n  nope: 1\nparallel:\n  tensor_model_parallel_size: 2.5\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad, ["rollout.group_size=x"])
    text = str(err.value)
    assert f"train.lr='fast' ({bad}:2)" in text
    assert f"train.nope=1 ({bad}:3)" in text
    assert "parallel.tensor_model_parallel_size" in text and f"{bad}:5" in text
    assert "rollout.group_size='x' (command line)" in text
    assert len(err.value.issues) == 4


def test_cyclic_extends(tmp_path):
    write(tmp_path / "a.yaml", "extends: b.yaml\n")
    write(tmp_path / "b.yaml", "extends: a.yaml\n")
    with pytest.raises(ConfigError, match="cyclic"):
        load_config(tmp_path / "a.yaml")


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(None, ["train.lr"])


def test_resolved_config_saved(tmp_path):
    cfg = load_config(None, [f"logging.run_dir={tmp_path}/run-${{now:%Y}}", "model.hf_path=x", "data.train_path=y"])
    out = save_resolved(cfg, tmp_path)
    again = OmegaConf.load(out)
    assert again.train.lr == cfg.train.lr
    assert "${" not in again.logging.run_dir
