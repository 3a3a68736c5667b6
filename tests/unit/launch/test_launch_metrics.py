"""Metric sinks (JSON lines, TensorBoard), stage timers and the PNG curves."""
import json
import math
import time

import pytest
import torch

from megarl.algorithms.metrics import mean_metric
from megarl.launch.metric_sinks import MetricsLogger, StageTimer, read_metrics, save_plots, to_float


def test_jsonl_and_tensorboard_receive_the_same_values(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(tmp_path, tensorboard=True, jsonl=True)
    for step in range(3):
        log.log(step, {"rollout/reward_mean": 0.1 * step, "loss/clip_frac": torch.tensor(0.5),
                       "mismatch/log_ratio_abs_mean": mean_metric(torch.tensor([1.0, 3.0]), torch.tensor([1, 1]))})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[2]["rollout/reward_mean"] == pytest.approx(0.2)
    assert rows[0]["mismatch/log_ratio_abs_mean"] == pytest.approx(2.0)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("rollout/reward_mean")
    assert [e.step for e in events] == [0, 1, 2]
    assert [e.value for e in events] == pytest.approx([0.0, 0.1, 0.2])


def test_resumed_run_rows_replace_earlier_ones(tmp_path):
    for rows in ([0, 1, 2], [2, 3]):  # a run killed after logging step 2, resumed from step 2
        log = MetricsLogger(tmp_path, tensorboard=False)
        for step in rows:
            log.log(step, {"x": float(step * 10 + len(rows))})
        log.close()
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (0, 3.0), (1, 13.0), (2, 22.0), (3, 32.0)]


def test_plots_are_written_from_the_log(tmp_path):
    import matplotlib.image as mpimg

    log = MetricsLogger(tmp_path, tensorboard=False)
    for step in range(4):
        log.log(step, {"rollout/reward_mean": step / 4, "mismatch/log_ratio_abs_mean": 0.01})
    log.close()
    written = save_plots(tmp_path)
    assert sorted(p.name for p in written) == ["mismatch.png", "reward.png"]
    image = mpimg.imread(tmp_path / "reward.png")
    assert image.shape[0] > 100 and image.shape[1] > 100


def test_plots_skip_missing_series(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False)
    log.log(0, {"rollout/reward_mean": 0.5})
    log.close()
    assert [p.name for p in save_plots(tmp_path)] == ["reward.png"]


def test_stage_timer_and_to_float():
    timer = StageTimer()
    with timer("rollout"):
        time.sleep(0.02)
    with timer("train"):
        pass
    m = timer.metrics()
    assert m["timing/rollout_s"] >= 0.02 and m["timing/step_s"] == pytest.approx(m["timing/rollout_s"] + m["timing/train_s"])
    assert to_float(torch.tensor(2.5)) == 2.5 and math.isnan(to_float(float("nan")))


def test_wandb_missing_fails_before_training(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLogger(tmp_path, tensorboard=False, jsonl=False, wandb=True)
