"""SGLang custom weight loader used by ``test_families_v3_glm.py`` to check weight names (no tests here).

It runs inside the SGLang scheduler process (``--custom-weight-loader``, then
``/update_weights_from_tensor`` with this function's import path as ``load_format``) and asks the
served model's own ``load_weights`` which names it consumes: every floating-point parameter is
set to NaN, the tensors are loaded, and a parameter still holding NaN was not written. With all
tensors, nothing may stay NaN (every engine parameter has a source); leaving out one tensor must
leave some parameter NaN (that tensor was consumed, not silently ignored, which SGLang does with
unknown names). The report goes to the JSON file named by ``MEGARL_NAME_PROBE_OUT``.
"""
import json
import os

import torch


def check_sglang_names(model, named_tensors) -> None:
    """SGLang custom-loader signature: ``(model, [(hf_name, tensor), ...])``."""
    params = dict(model.named_parameters())

    def unfilled(subset) -> list[str]:
        with torch.no_grad():
            for param in params.values():
                if param.is_floating_point():
                    param.fill_(float("nan"))
        model.load_weights(list(subset))
        return sorted(n for n, p in params.items() if p.is_floating_point() and bool(torch.isnan(p).any()))

    report = {"engine_params": sorted(params), "unfilled_with_all": unfilled(named_tensors), "ignored": []}
    for i, (name, _) in enumerate(named_tensors):
        if not unfilled(named_tensors[:i] + named_tensors[i + 1:]):
            report["ignored"].append(name)
    unfilled(named_tensors)  # leave the engine with the real weights
    with open(os.environ["MEGARL_NAME_PROBE_OUT"], "w", encoding="utf-8") as f:
        json.dump(report, f)
