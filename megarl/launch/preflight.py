"""The check before anything starts: the config's own rules and every layer's, reported at once.

:func:`preflight` gathers :func:`megarl.config.validate.config_issues` (the rules that need only the
config and the model's ``config.json``) with the rules each layer enforces at run time and can check
on paper: the model's weights against its config.json
(:func:`megarl.conversion.config_check.check_weights_match_config`), the FP8 recipe
(:func:`megarl.training.fp8.fp8_recipe_issues`), the pipeline stages' layers
(:class:`megarl.weight_sync.layout.TrainerLayout`) and ``model.load_dir``
(:func:`megarl.conversion.load_dir.check_load_dir`). Each rule is defined once, in its layer; this
module only collects. :func:`prepare_config` is what every ``megarl`` command that takes a config runs.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from megarl.config.checker import Checker
from megarl.config.device import use_cuda
from megarl.config.loader import ConfigError, ConfigIssue, compose_config
from megarl.config.model_rules import read_hf_config
from megarl.config.parallel import uneven_stage_error
from megarl.config.validate import config_issues, fit_issues


def _check_fp8_recipe(c: Checker) -> None:
    """The training layer's FP8 recipe rules (:func:`megarl.training.fp8.fp8_recipe_issues`)."""
    from megarl.training.fp8 import fp8_recipe_issues

    cfg = c.cfg
    if cfg.train.fp8 is None:
        return
    for key, message in fp8_recipe_issues(cfg.train, cfg.algorithm.policy_loss, cuda=use_cuda(cfg.cluster.device)):
        c.check(False, key, message)


def _check_stage_layers(c: Checker) -> None:
    """``parallel.num_layers_in_first/last_pipeline_stage``: where the weight-sync layout
    (``TrainerLayout``, tested against Megatron's ``get_transformer_layer_offset`` /
    ``get_num_layers_to_build``) puts the layers, once Megatron's own split rule holds."""
    from megarl.weight_sync.layout import LayoutError, TrainerLayout

    p = c.cfg.parallel
    first, last = p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
    if first is None and last is None:
        return
    num_layers = read_hf_config(c.cfg.model.hf_path).num_hidden_layers
    if uneven_stage_error(p, num_layers) is not None:
        return  # reported by the config's rule
    try:
        TrainerLayout(pipeline_model_parallel_size=p.pipeline_model_parallel_size,
                      virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
                      num_layers_in_first_pipeline_stage=first,
                      num_layers_in_last_pipeline_stage=last).layer_location(0, num_layers)
    except LayoutError as err:
        c.check(False, "parallel.num_layers_in_first_pipeline_stage",
                f"{err} (num_hidden_layers={num_layers} from config.json)")


def _check_load_dir(c: Checker) -> None:
    """``model.load_dir`` holds ``model.hf_path``'s model (:func:`megarl.conversion.load_dir.check_load_dir`)."""
    load_dir = c.cfg.model.load_dir
    if not load_dir:
        return
    from megarl.conversion.load_dir import check_load_dir

    try:
        check_load_dir(load_dir, c.cfg.model.hf_path)
    except (OSError, ValueError) as e:  # not a checkpoint, another model's, unreadable metadata
        c.check(False, "model.load_dir", str(e))


def _check_hf_weights(c: Checker) -> None:
    """``model.hf_path``'s weights: complete safetensors headers holding what its ``config.json``
    says (layers, experts, every tensor's shape), as ``megarl convert`` checks them
    (:func:`megarl.conversion.config_check.check_weights_match_config`; headers only, no data read).
    A directory without weights (the GPU recipes' ``configs/models/*``: config.json alone) is skipped."""
    from megarl.conversion.config_check import check_weights_match_config
    from megarl.conversion.hf_io import INDEX_FILE
    from megarl.errors import UserError

    hf_dir = Path(c.cfg.model.hf_path)
    if not (hf_dir / INDEX_FILE).is_file() and not any(hf_dir.glob("*.safetensors")):
        return
    try:
        check_weights_match_config(hf_dir)
    except UserError as e:  # CheckpointFileError (missing, truncated), ConfigMismatchError
        c.check(False, "model.hf_path", e.one_line())


def _run(c: Checker, skip_errors: bool, rule: Callable[[Checker], Any]) -> None:
    """A layer's rule on a config that may hold values already reported as invalid: then a rule that
    cannot compute is skipped, not raised (as the config's own cross-field rules are)."""
    try:
        rule(c)
    except (ArithmeticError, TypeError, ValueError, OSError):
        if not skip_errors:
            raise


def preflight(cfg: DictConfig, *, check_paths: bool = True, check_fit: bool = True,
              load_issues: Sequence[ConfigIssue] = ()) -> DictConfig:
    """Check a loaded config against the config's rules and every layer's, all problems at once.

    Args:
        cfg: from :func:`megarl.config.loader.load_config`.
        check_paths: also check the model, data, tokenizer and checkpoint paths and read config.json.
        check_fit: with ``check_paths``, also check that the trainer and engine ranks fit the GPU's
            memory (:func:`megarl.config.validate.fit_issues`); beside other problems as long as
            the sizes it needs are valid (a refusal is reported with them, not hidden).
        load_issues: the loader's problems (unknown keys, wrong types: those values were not applied,
            :func:`megarl.config.loader.compose_config`), reported first, with the rules' problems.

    Returns:
        ``cfg``, unchanged, when valid.

    Raises:
        ConfigError: listing every problem found, each naming its key.
    """
    try:
        issues = [*load_issues, *config_issues(cfg, check_paths=check_paths)]
    except ConfigError as e:  # a required key missing: nothing else can be checked
        raise ConfigError([*load_issues, *e.issues]) from None
    c = Checker(cfg)
    c.issues = list(issues)
    _run(c, bool(issues), _check_fp8_recipe)
    if check_paths:
        _run(c, bool(issues), _check_stage_layers)  # an unreadable config.json is already reported
        if not any(issue.key == "model.hf_path" for issue in c.issues):
            _check_hf_weights(c)
        if not any(issue.key == "model.hf_path" for issue in c.issues):
            _check_load_dir(c)
    if check_paths and check_fit and not any(i.key.startswith(_FIT_INPUTS) for i in c.issues):
        _run(c, bool(c.issues), lambda c: c.issues.extend(fit_issues(cfg)))
    if c.issues:
        raise ConfigError(c.issues)
    return cfg


_FIT_INPUTS = ("model.", "cluster.", "parallel.tensor_model", "parallel.pipeline", "parallel.expert",
               "parallel.context", "parallel.virtual", "parallel.num_layers", "rollout.engine", "train.fp8",
               "train.precision")
"""Keys whose problem makes the fit check meaningless (the sizes it computes with); a problem
elsewhere (``parallel.sequence_parallel``, a typo, a loss setting) is reported beside its refusal."""


def prepare_config(path: str, overrides: Sequence[str], *, cpu_scale: bool = False,
                   check_fit: bool = True) -> DictConfig:
    """Load, optionally scale down to one CPU host (`megarl.launch.cpu_scale`, its ``cpu-scale:``
    lines printed), resolve ``tiny:`` model paths and hub ids, and validate a config (:func:`preflight`).

    Raises:
        ConfigError: every problem found in the config.
    """
    from megarl.config.hub import resolve_hub_ids
    from megarl.launch import cpu_scale as scale
    from megarl.models.tiny import resolve_model_path
    from megarl.plugins import absolute_specs

    cfg, load_issues, _ = compose_config(path, overrides)  # reported with the rules' problems
    resolve_hub_ids(cfg)  # before --cpu-scale, which reads the model's config.json
    if cpu_scale:
        try:
            cfg, notes = scale.cpu_scale(cfg)
        except ValueError as e:
            raise ConfigError([ConfigIssue("model.hf_path", str(e), cfg.model.hf_path)]) from e
        scale.print_notes(notes)
    absolute_specs(cfg)  # plugin files named relative to here mean the same file in every process
    if OmegaConf.is_missing(cfg.model, "hf_path") or not cfg.model.hf_path.startswith("tiny:"):
        return preflight(cfg, check_fit=check_fit, load_issues=load_issues)
    try:
        cfg.model.hf_path = resolve_model_path(cfg.model.hf_path)
    except ValueError as e:
        raise ConfigError([*load_issues, ConfigIssue("model.hf_path", str(e), cfg.model.hf_path)]) from e
    return preflight(cfg, check_fit=check_fit, load_issues=load_issues)
