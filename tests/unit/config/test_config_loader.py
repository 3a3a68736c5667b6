"""Loading: YAML composition with extends, overrides, error collection with file and line."""
import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

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


def _issue_text(overrides, path=None) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    return str(err.value)


def test_hydra_remove_resets_a_schema_field_to_its_default(tmp_path):
    """``~key`` on a schema field (or a whole section) goes back to the schema default, not the YAML's."""
    leaf = write(tmp_path / "leaf.yaml", "train:\n  lr: 1.0e-5\n  fp8: e4m3\nrollout:\n  agent:\n    max_turns: 9\n")
    cfg = load_config(leaf, ["~train.lr", "~train.fp8=e4m3", "~rollout.agent", "~model.hf_path"])
    assert cfg.train.lr == MegarlConfig().train.lr and cfg.train.fp8 is None
    assert cfg.rollout.agent.max_turns == 4 and OmegaConf.get_type(cfg.rollout.agent).__name__ == "AgentConfig"
    assert OmegaConf.is_missing(cfg.model, "hf_path")
    cfg.train.lr = -1.0  # still typed after removal
    with pytest.raises(ValidationError):
        cfg.train.lr = "fast"


def test_hydra_remove_deletes_a_free_dict_key(tmp_path):
    leaf = write(tmp_path / "leaf.yaml", "rollout:\n  tools:\n    python: {timeout_s: 2}\n    calculator: {}\n")
    cfg = load_config(leaf, ["~rollout.tools.calculator", "~rollout.tools.python.timeout_s=2"])
    assert OmegaConf.to_container(cfg.rollout.tools) == {"python": {}}
    assert OmegaConf.to_container(load_config(leaf, ["~rollout.tools"]).rollout.tools) == {}


def test_hydra_remove_errors_name_the_override(tmp_path):
    leaf = write(tmp_path / "leaf.yaml", "rollout:\n  tools:\n    python: {timeout_s: 2}\n")
    text = _issue_text(["~rollout.tools.search", "~train.lr=0.5", "~nosuch.key"], leaf)
    assert "rollout.tools.search (command line: ~rollout.tools.search): cannot remove: the key does not exist" in text
    assert "(command line: ~train.lr=0.5): not removed: its value is 1e-06, not 0.5" in text
    assert "(command line: ~nosuch.key)" in text


def test_hydra_add(tmp_path):
    """``+key=value`` adds a key that does not exist and refuses one that does (every schema field exists)."""
    leaf = write(tmp_path / "leaf.yaml", "rollout:\n  tools:\n    python: {timeout_s: 2}\n")
    cfg = load_config(leaf, ["+rollout.tools.calculator={}", "+rollout.tools.python.memory_mb=512"])
    assert OmegaConf.to_container(cfg.rollout.tools) == {"python": {"timeout_s": 2, "memory_mb": 512}, "calculator": {}}
    text = _issue_text(["+train.lr=0.1", "+rollout.tools.python.timeout_s=3"], leaf)
    assert "(command line: +train.lr=0.1): cannot add: the key already exists" in text
    assert "(command line: +rollout.tools.python.timeout_s=3): cannot add" in text
    assert "train.nope" in _issue_text(["+train.nope=1"])  # a typed section takes no new key
    assert "unknown key" in _issue_text(["+train.nope=1"])


def test_hydra_force_add_or_override(tmp_path):
    leaf = write(tmp_path / "leaf.yaml", "rollout:\n  tools:\n    python: {timeout_s: 2}\n")
    cfg = load_config(leaf, ["++train.lr=0.1", "++rollout.tools.python.timeout_s=3", "++rollout.tools.calculator={}"])
    assert cfg.train.lr == 0.1 and cfg.rollout.tools.python.timeout_s == 3 and "calculator" in cfg.rollout.tools
    assert "unknown key" in _issue_text(["++train.nope=1"])


def test_override_grammar_errors():
    for text in ("+train.lr", "++", "~", "=3"):
        with pytest.raises(ConfigError, match="Hydra's grammar"):
            load_config(None, [text])


def test_as_megarl_config_types_the_config_itself():
    """The loader's config and a resolved one read back from YAML (as the Ray actors read it) are
    returned as they are; what is not a mapping config is a TypeError naming its type."""
    from megarl.config.loader import to_yaml
    from megarl.config.schema import as_megarl_config

    cfg = load_config(None, ["train.seed=7"])
    assert as_megarl_config(cfg) is cfg
    read_back = OmegaConf.create(to_yaml(cfg))
    assert as_megarl_config(read_back) is read_back and read_back.train.seed == 7
    for bad in (OmegaConf.create([1, 2]), {"train": {}}):
        with pytest.raises(TypeError, match=f"got {type(bad).__name__}"):
            as_megarl_config(bad)
