"""Trainer checkpoints carry the HF config and tokenizer: ``megarl convert megatron-to-hf
RUN/checkpoints/step_N OUT`` needs no ``--hf-config``, and a step directory is a ``model.load_dir``.
The driver's HF export of the checkpoint runs in the background and writes the same directory.

The checkpoint is written by the driver's real ``CheckpointStage.save`` around a real one-rank
trainer save (the trainer group is a stand-in that runs the trainer in a gloo process). The trainer
loaded the tiny model's HF weights and never stepped, so the reference is the original directory:
safetensors (read with the safetensors library), config.json and tokenizer files, byte for byte.
"""
import multiprocessing
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from megarl.launch.hf_export import MAX_EXPORT_RANKS
from megarl.testing.multiproc import run_ranks


def _cfg(hf_dir, **model):
    from megarl.config.schema import MegarlConfig

    cfg = MegarlConfig()
    cfg.model.hf_path = str(hf_dir)
    for key, value in model.items():
        setattr(cfg.model, key, value)
    cfg.cluster.device, cfg.train.precision = "cpu", "fp32"
    return cfg


def _save_worker(rank, world_size, hf_dir, directory):
    from megarl.conversion.initial_weights import initial_weights
    from megarl.training.parallel_state import destroy_parallel
    from megarl.training.trainer_build import build_trainer

    multiprocessing.current_process().daemon = False  # dist_checkpointing's writers fork processes
    cfg = _cfg(hf_dir)
    trainer = build_trainer(cfg, load_weights=initial_weights(cfg.model))
    trainer.save_checkpoint(directory)
    del trainer
    destroy_parallel()


class TrainerGroupStandIn:
    """``TrainerGroup.save_checkpoint``: one real trainer rank in a gloo process."""

    def __init__(self, hf_dir):
        self.hf_dir = str(hf_dir)

    def save_checkpoint(self, directory):
        run_ranks(_save_worker, 1, args=(self.hf_dir, directory), timeout_s=240)


def make_run(hf_dir, run_dir: Path, step: int, **checkpoint):
    """The driver's checkpoint stage with only what ``save`` uses (no Ray, no engines)."""
    from megarl.cluster.colocated import EngineMemoryLoan
    from megarl.data.sampler import ResumableSampler
    from megarl.launch.checkpoint_stage import CheckpointStage
    from megarl.launch.rollout_stage import RolloutStage
    from megarl.launch.run_state import RunState
    from megarl.launch.train_stage import TrainStage

    cfg = OmegaConf.structured(_cfg(hf_dir))
    cfg.logging.run_dir = str(run_dir)
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    trainer = TrainerGroupStandIn(hf_dir)
    rollout = RolloutStage(cfg.rollout, [], ResumableSampler(4, seed=0), None, num_steps=step, depth=0, sync=None,
                           heal=lambda version: [])
    train = TrainStage(trainer, EngineMemoryLoan(lends=False, weights_each_step=True), global_batch_size=1)
    return CheckpointStage(cfg.checkpoint, cfg.model, run_dir, trainer=trainer, rollout=rollout, train=train,
                           config_yaml="", state=RunState())


@pytest.fixture(scope="module")
def saved(tiny_moe_dir, tmp_path_factory):
    """``(run, step directory, whether the HF export was still running when save_checkpoint returned)``,
    the export (``checkpoint.hf_export_interval=1``) finished."""
    run = make_run(tiny_moe_dir, tmp_path_factory.mktemp("run"), step=3, hf_export_interval=1)
    ckpt = run.save(step=3)
    in_flight = run.hf_export.in_flight
    run.wait_for_export()
    return run, ckpt, in_flight


@pytest.fixture(scope="module")
def step_dir(saved):
    return saved[1]


def _assert_same_hf(original: Path, exported: Path):
    from megarl.testing.checkpoints import load_safetensors_dir

    ref, got = load_safetensors_dir(original), load_safetensors_dir(exported)  # one file, or one per rank
    assert sorted(got) == sorted(ref)
    for name, tensor in ref.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (exported / name).read_bytes() == (original / name).read_bytes(), name


@pytest.mark.timeout(420)
def test_export_of_a_step_dir_needs_no_hf_config(tiny_moe_dir, step_dir, tmp_path):
    import shutil

    from megarl.cli import main as cli_main
    from megarl.conversion.convert import megatron_to_hf_dir

    assert step_dir.name == "step_000003"
    stored = step_dir / "trainer" / "hf_config"
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        assert (stored / name).read_bytes() == (tiny_moe_dir / name).read_bytes(), name
    assert not list(stored.glob("*.safetensors"))
    assert cli_main(["convert", "megatron-to-hf", str(step_dir), str(tmp_path / "hf")]) == 0
    _assert_same_hf(tiny_moe_dir, tmp_path / "hf")
    # without the stored config (a checkpoint from before): the error says what to pass
    bare = tmp_path / "bare"
    shutil.copytree(step_dir, bare, ignore=shutil.ignore_patterns("hf_config"))
    with pytest.raises(FileNotFoundError, match="--hf-config"):
        megatron_to_hf_dir(bare, tmp_path / "hf_bare")
    megatron_to_hf_dir(bare, tmp_path / "hf_bare", hf_config_dir=tiny_moe_dir)
    _assert_same_hf(tiny_moe_dir, tmp_path / "hf_bare")


def test_background_export_during_training(tiny_moe_dir, saved):
    """The driver's HF export (``checkpoint.hf_export_interval``) ran after save_checkpoint returned
    and wrote the checkpoint's weights with the stored config and tokenizer."""
    run, ckpt, in_flight = saved
    assert in_flight, "save_checkpoint returned before the export finished"
    assert run.hf_export.ranks == min(MAX_EXPORT_RANKS, os.cpu_count())  # the run's export is parallel
    assert sorted(p.name for p in (run.run_dir / "hf").iterdir()) == [ckpt.name]
    _assert_same_hf(tiny_moe_dir, run.run_dir / "hf" / ckpt.name)


def _params_worker(rank, world_size, hf_dir, load_dir):
    from megarl.conversion.initial_weights import initial_weights
    from megarl.training.parallel_state import destroy_parallel
    from megarl.training.trainer_build import build_trainer

    # load_dir None: the HF loader; else no HF weights read (an ignored load_dir leaves random weights)
    cfg = _cfg(hf_dir, load_dir=load_dir, load_weights=load_dir is None)
    trainer = build_trainer(cfg, load_weights=initial_weights(cfg.model))
    out = {n: p.detach().clone() for n, p in trainer.model_chunks[0].module.named_parameters()}
    del trainer
    destroy_parallel()
    return out


@pytest.mark.timeout(300)
def test_step_dir_is_a_load_dir(tiny_moe_dir, step_dir):
    """Every parameter of a trainer started from the step directory equals the HF loader's."""
    from megarl.conversion.load_dir import check_load_dir

    check_load_dir(step_dir, tiny_moe_dir)
    loaded = run_ranks(_params_worker, 1, args=(str(tiny_moe_dir), str(step_dir)), timeout_s=240)[0]
    reference = run_ranks(_params_worker, 1, args=(str(tiny_moe_dir), None), timeout_s=240)[0]
    assert sorted(loaded) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor), name
