"""Resume wins over ``model.load_dir``: the trainer ranks of a resumed run do not read it."""
from omegaconf import OmegaConf

from megarl.config.schema import MegarlConfig
from megarl.launch.run import trainer_config


def test_resume_wins_over_load_dir():
    cfg = OmegaConf.structured(MegarlConfig())
    cfg.model.load_dir = "/ckpt/converted"
    assert trainer_config(cfg, resuming=False) is cfg
    resumed = trainer_config(cfg, resuming=True)
    assert resumed.model.load_dir is None
    assert cfg.model.load_dir == "/ckpt/converted", "the run's own config is not changed"
    assert OmegaConf.to_container(resumed.train) == OmegaConf.to_container(cfg.train)
