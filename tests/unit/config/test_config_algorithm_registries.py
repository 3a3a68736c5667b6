"""The algorithm fields take their choices from the registries (issue 36): a loss, estimator or
correction registered anywhere, or named by import path, is valid without touching
megarl/config/domains.py; its declared hyperparameters are checked through its entry; a path that does
not load, or a function that does not fit the call protocol, is refused naming the field."""
import sys

import pytest
from config_issues import validate_issues

from megarl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    ROLLOUT_CORRECTIONS,
    register_advantage_estimator,
    register_policy_loss,
)
from megarl.config.domains import DOMAINS

LOSS = '''
from megarl.algorithms import register_policy_loss


def scaled_loss(logprobs, old_logprobs, advantages, loss_mask, *, loss_agg_mode, normalizer, is_weights, entropy,
                scale):
    return -scale * (advantages[:, None] * logprobs * loss_mask).sum(), {}


def fixed_loss(logprobs, old_logprobs, advantages, loss_mask, *, loss_agg_mode, normalizer, is_weights, entropy):
    return logprobs.sum() * 0, {}


def no_protocol(logprobs):
    return logprobs.sum(), {}


@register_policy_loss("REGISTERED", hyperparameters={"clip_high": "clip_high"})
def registered_loss(logprobs, old_logprobs, advantages, loss_mask, *, loss_agg_mode, normalizer, is_weights,
                    entropy, clip_high):
    return logprobs.sum() * 0, {}
'''


@pytest.fixture
def registries():
    """Restore the three algorithm registries after a test registers into them."""
    saved = [(r, dict(r)) for r in (POLICY_LOSSES, ADVANTAGE_ESTIMATORS, ROLLOUT_CORRECTIONS)]
    yield
    for registry, entries in saved:
        registry.clear()
        registry.update(entries)


@pytest.fixture
def plugin_module(tmp_path, monkeypatch, registries):
    """A module outside the package, importable from sys.path (as PYTHONPATH makes it); its name."""
    name = f"user_losses_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(LOSS.replace("REGISTERED", f"{name}_registered"))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_newly_registered_loss_becomes_a_valid_choice(good_overrides, registries):
    assert "algorithm.policy_loss" in validate_issues(good_overrides + ["algorithm.policy_loss=my_new_loss"])
    assert "my_new_loss" not in str(DOMAINS["algorithm.policy_loss"])

    @register_policy_loss("my_new_loss", hyperparameters={"clip_low": "clip_low"})
    def my_new_loss(logprobs, old_logprobs, advantages, loss_mask, *, loss_agg_mode, normalizer, is_weights,
                    entropy, clip_low):
        return logprobs.sum() * 0, {}

    assert "my_new_loss" in str(DOMAINS["algorithm.policy_loss"])  # read from the registry, not a copy
    assert validate_issues(good_overrides + ["algorithm.policy_loss=my_new_loss"]) == {}


def test_unknown_names_are_refused_naming_the_field_and_the_registered_choices(good_overrides):
    issues = validate_issues(good_overrides + ["algorithm.policy_loss=dapo", "algorithm.advantage_estimator=gae",
                                               "algorithm.rollout_correction=wis"])
    assert "algorithm.policy_loss='dapo'" in issues["algorithm.policy_loss"]
    assert "gspo, gspo_token, ppo_clip" in issues["algorithm.policy_loss"]
    assert "dr_grpo, grpo, reinforce_pp, rloo" in issues["algorithm.advantage_estimator"]
    assert "'none' or a registered rollout correction (decoupled, icepop, mis, tis)" in issues[
        "algorithm.rollout_correction"]
    assert "import path" in issues["algorithm.policy_loss"]


def test_a_loss_by_import_path_with_its_own_hyperparameters_validates(good_overrides, plugin_module):
    ok = [f"algorithm.policy_loss={plugin_module}:scaled_loss", "algorithm.policy_loss_kwargs={scale: 0.5}"]
    assert validate_issues(good_overrides + ok) == {}
    assert validate_issues(good_overrides + [f"algorithm.policy_loss={plugin_module}:fixed_loss"]) == {}


@pytest.mark.parametrize("overrides, key, message", [
    (["algorithm.policy_loss=no_such_module_xyz:loss"], "algorithm.policy_loss",
     "no module named 'no_such_module_xyz'"),
    (["algorithm.policy_loss={m}:missing"], "algorithm.policy_loss", "has no attribute 'missing'"),
    (["algorithm.policy_loss={m}:scaled_loss"], "algorithm.policy_loss", "missing a required argument: 'scale'"),
    (["algorithm.policy_loss={m}:fixed_loss", "algorithm.policy_loss_kwargs={scale: 1}"], "algorithm.policy_loss",
     "unexpected keyword argument 'scale'"),
    (["algorithm.policy_loss={m}:no_protocol"], "algorithm.policy_loss", "fn(logprobs, old_logprobs, advantages"),
    (["algorithm.policy_loss=ppo_clip", "algorithm.clip_low=0.2", "algorithm.clip_high=0.2",
      "algorithm.policy_loss_kwargs={clip_c: 3}"], "algorithm.policy_loss_kwargs.clip_c", "set it there"),
    (["algorithm.advantage_estimator={m}:missing"], "algorithm.advantage_estimator", "has no attribute"),
    (["algorithm.rollout_correction={m}:no_protocol"], "algorithm.rollout_correction",
     "fn(old_logprobs, rollout_logprobs, loss_mask"),
], ids=["module", "attribute", "missing-kwarg", "extra-kwarg", "protocol", "kwarg-shadows-field", "estimator",
        "correction"])
def test_bad_import_paths_and_signatures_are_refused_naming_the_field(good_overrides, plugin_module, overrides, key,
                                                                      message):
    issues = validate_issues(good_overrides + [o.replace("{m}", plugin_module) for o in overrides])
    assert key in issues and message in issues[key], issues


def test_a_plugin_module_registers_a_loss_that_validation_then_accepts(good_overrides, plugin_module, registries):
    name = f"{plugin_module}_registered"
    issues = validate_issues(good_overrides + [f"plugins=[{plugin_module}]", f"algorithm.policy_loss={name}"])
    assert issues == {} and name in POLICY_LOSSES  # the plugins are imported before the field is checked


def test_declared_hyperparameters_are_checked_through_the_entry(good_overrides):
    gspo = validate_issues(good_overrides + ["algorithm.clip_high=0.2"])
    assert "GSPO clips the sequence-level ratio" in gspo["algorithm.clip_high"]
    assert validate_issues(good_overrides + ["algorithm.policy_loss=ppo_clip", "algorithm.clip_low=0.2",
                                             "algorithm.clip_high=0.28", "algorithm.clip_c=3.0"]) == {}
    dual = validate_issues(good_overrides + ["algorithm.clip_c=3.0"])  # gspo does not take clip_c
    assert "policy_loss=gspo does not take it (a loss that does: ppo_clip)" in dual["algorithm.clip_c"]


def test_the_estimators_group_size_comes_from_its_entry(good_overrides, registries):
    one = ["rollout.group_size=1", "train.global_batch_size=4"]
    assert "needs >= 2 trajectories" in validate_issues(good_overrides + one)["rollout.group_size"]

    @register_advantage_estimator("batch_baseline")
    def batch_baseline(rewards, group_ids):
        return rewards - rewards.mean()

    assert validate_issues(good_overrides + one + ["algorithm.advantage_estimator=batch_baseline"]) == {}
