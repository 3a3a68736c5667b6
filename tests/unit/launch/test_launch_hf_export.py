"""HF export during training runs in the background (`megarl.launch.hf_export`): the driver's
``save_checkpoint`` returns while the export runs; the next commit (checkpoint rotation) waits for
it, so the directory it reads is never deleted under it; a failed export is retried, then logged
and counted without stopping training; the end of the run raises the last export's error.

The real checkpoint stage (``CheckpointStage.save``) with a stand-in trainer (makes the directory)
and an export that blocks until released (no processes)."""
import threading
import time
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from megarl.cluster.colocated import EngineMemoryLoan
from megarl.config.schema import MegarlConfig
from megarl.data.sampler import ResumableSampler
from megarl.launch.checkpoint_stage import CheckpointStage
from megarl.launch.hf_export import BackgroundExport
from megarl.launch.rollout_stage import RolloutStage
from megarl.launch.run import Run
from megarl.launch.run_state import RunState
from megarl.launch.train_stage import TrainStage

pytestmark = pytest.mark.timeout(60)


class TrainerStandIn:
    def save_checkpoint(self, directory):
        import os

        os.makedirs(directory)


class BlockingExport:
    """Blocks until ``release``; records whether the checkpoint still existed when it finished."""

    def __init__(self, fail: bool = False):
        self.started, self.release, self.fail = threading.Event(), threading.Event(), fail
        self.finished: list[tuple[str, bool]] = []

    def __call__(self, ckpt, out):
        self.started.set()
        assert self.release.wait(30)
        self.finished.append((ckpt.name, (ckpt / "trainer").is_dir()))
        if self.fail:
            raise OSError("disk full")
        out.mkdir(parents=True)


def _checkpoint_stage(tmp_path, export, **checkpoint):
    cfg = OmegaConf.structured(MegarlConfig())
    cfg.model.hf_path = str(tmp_path / "no_model")  # no config.json: no HF metadata copied
    cfg.checkpoint.hf_export_interval = 1
    for key, value in checkpoint.items():
        setattr(cfg.checkpoint, key, value)
    trainer = TrainerStandIn()
    rollout = RolloutStage(cfg.rollout, [], ResumableSampler(4, seed=0), None, num_steps=2, depth=0, sync=None,
                           heal=lambda version: [])
    train = TrainStage(trainer, EngineMemoryLoan(lends=False, weights_each_step=True),
                       global_batch_size=1)
    return CheckpointStage(cfg.checkpoint, cfg.model, tmp_path / "run", trainer=trainer, rollout=rollout, train=train,
                           config_yaml="", state=RunState(), hf_export=BackgroundExport(export))


def test_save_returns_while_exporting_and_rotation_waits(tmp_path):
    export = BlockingExport()
    ckpt = _checkpoint_stage(tmp_path, export, keep_last=1)
    first = ckpt.save(1)  # returns with the export blocked
    assert export.started.wait(10) and ckpt.hf_export.in_flight
    assert not (ckpt.run_dir / "hf" / "step_000001").exists()
    second = threading.Thread(target=ckpt.save, args=(2,))
    second.start()
    time.sleep(0.5)  # the second save waits before its commit, which would delete step_000001
    assert second.is_alive() and (first.parent / "latest").read_text() == "step_000001"
    export.release.set()
    second.join(10)
    assert not second.is_alive()
    assert export.finished[0] == ("step_000001", True), "the exported checkpoint existed until the export ended"
    assert (first.parent / "latest").read_text() == "step_000002" and not first.exists()  # rotated afterwards
    ckpt.wait_for_export()
    assert [name for name, _ in export.finished] == ["step_000001", "step_000002"]
    assert sorted(p.name for p in (ckpt.run_dir / "hf").iterdir()) == ["step_000001", "step_000002"]


def test_a_failed_export_is_retried_reported_and_never_stops_training(tmp_path, caplog):
    """Issue 35 item 3: an export that fails every try is logged and counted; the next checkpoint is
    saved and committed and its export goes ahead (before, the next save_checkpoint raised the error
    and the run aborted)."""
    export = BlockingExport()

    def first_fails(ckpt, out):
        export.fail = ckpt.name == "step_000001"
        export(ckpt, out)

    ckpt = _checkpoint_stage(tmp_path, first_fails)
    ckpt.save(1)
    export.release.set()
    with caplog.at_level("ERROR", logger="megarl.train"):
        ckpt.save(2)  # does not raise
    assert (ckpt.run_dir / "checkpoints" / "latest").read_text() == "step_000002"
    assert export.finished[:2] == [("step_000001", True)] * 2  # tried twice, the checkpoint still there
    assert [name for name, _ in ckpt.hf_export.failures] == ["step_000001"]
    assert "training goes on" in caplog.text and "try 2 of 2" in caplog.text
    ckpt.wait_for_export()  # step 2's export succeeds
    assert (ckpt.run_dir / "hf" / "step_000002").is_dir() and not (ckpt.run_dir / "hf" / "step_000001").exists()


def test_a_transient_export_failure_is_retried(tmp_path):
    export = BlockingExport(fail=True)
    export.release.set()
    calls = []

    def flaky(ckpt, out):
        calls.append(ckpt.name)
        export.fail = len(calls) == 1  # the first try fails, the retry succeeds
        export(ckpt, out)

    ckpt = _checkpoint_stage(tmp_path, flaky)
    ckpt.save(1)
    ckpt.wait_for_export()
    assert calls == ["step_000001"] * 2 and (ckpt.run_dir / "hf" / "step_000001").is_dir()
    assert ckpt.hf_export.failures == []


def test_close_waits_for_the_export_and_does_not_raise(tmp_path):
    export = BlockingExport(fail=True)
    ckpt = _checkpoint_stage(tmp_path, export)
    ckpt.save(1)
    run = Run(tmp_path / "run", stages=SimpleNamespace(checkpoint=ckpt, log=SimpleNamespace(close=lambda: None)))
    threading.Timer(0.3, export.release.set).start()
    run.close()  # nothing else to stop; best effort: the error was logged by the export thread
    assert export.finished == [("step_000001", True)] * 2 and not ckpt.hf_export.in_flight  # tried twice


def test_wait_raises_the_last_export_error(tmp_path):
    export = BlockingExport(fail=True)
    ckpt = _checkpoint_stage(tmp_path, export)
    ckpt.save(1)
    export.release.set()
    with pytest.raises(OSError, match="disk full"):
        ckpt.wait_for_export()
    ckpt.wait_for_export()  # reported once
