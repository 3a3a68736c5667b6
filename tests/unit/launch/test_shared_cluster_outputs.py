"""What a shared cluster notices (issue 38 §5): output folders with the umask's mode, one eval report
per model path, evaluation seeds that depend on the eval config alone, the plan table's batch sizes."""
import os
import stat
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_output_folders_honour_the_umask(tmp_path, tiny_moe_dir):
    """The reference is the mode a plain mkdir gets under the same umask (0755 under 022)."""
    from megarl.conversion.convert import _atomic_dir

    old = os.umask(0o022)
    try:
        reference = tmp_path / "plain"
        reference.mkdir()
        converted = _atomic_dir(tmp_path / "converted", overwrite=False)  # the directory published as OUT_DIR
    finally:
        os.umask(old)
    assert _mode(converted) == _mode(reference) == 0o755
    plain = tmp_path / "plain_session_umask"
    plain.mkdir()  # the tiny model fixture was written under this session's umask
    assert _mode(Path(tiny_moe_dir)) == _mode(plain)


def test_eval_report_named_after_the_model_path(tmp_path):
    from megarl.launch.evaluate import _default_out

    one, two = tmp_path / "a" / "hf", tmp_path / "b" / "hf"
    assert _default_out(None, one) != _default_out(None, two)
    assert _default_out(None, one) == _default_out(None, one)
    assert _default_out(None, one).parent == Path("runs") / "eval"
    step = tmp_path / "run" / "checkpoints" / "step_3" / "trainer"
    assert _default_out(step, None) == tmp_path / "run" / "eval" / "step_3.json"


def test_eval_sampling_is_seeded_by_the_config_alone(tiny_moe_dir):
    """Without deterministic_sampling the evaluation's sampled pass still goes through a seeded
    engine: seeds from train.seed and the request only (so --checkpoint and --hf sample alike)."""
    from omegaconf import OmegaConf

    from megarl.config.loader import load_config
    from megarl.launch.rollout_actor import RolloutWorker, SeededEngine

    def worker(policy_version):
        cfg = load_config(REPO / "configs" / "base.yaml", [
            f"model.hf_path={tiny_moe_dir}", "rollout.deterministic_sampling=false",
            "data.eval_samples_per_prompt=2", "train.seed=11"])
        w = RolloutWorker.__ray_actor_class__(OmegaConf.to_yaml(cfg), ["http://127.0.0.1:9"], ["engine0"])
        w.sampled_eval_manager.policy_version = policy_version
        return w

    seeds = []
    for version in (0, 7):
        w = worker(version)
        engine = w.sampled_eval_manager.engine
        assert isinstance(engine, SeededEngine) and engine.seed == 11
        engine.start_step(-1)
        seeds.append([engine.seed_for([1, 2, 3]) for _ in range(2)])
    assert seeds[0] == seeds[1] and seeds[0][0] != seeds[0][1]


def test_plan_table_notes_every_recipe_batch():
    """The README's GPU table says "64 prompts x G8 per step unless noted": every recipe with another
    batch (read from its YAML) must be noted in that paragraph."""
    readme = (REPO / "README.md").read_text()
    start = readme.index("## Recipes at scale")
    section = " ".join(readme[start:readme.index("| recipe |", start)].split())
    assert "64 prompts x G8" in section
    for recipe in sorted((REPO / "configs").glob("*_gpu.yaml")):
        rollout = yaml.safe_load(recipe.read_text())["rollout"]
        prompts, group = rollout["num_prompts_per_step"], rollout["group_size"]
        if (prompts, group) != (64, 8):
            assert f"`configs/{recipe.name}`: {prompts} prompts x G{group}" in section, (recipe.name, section)
