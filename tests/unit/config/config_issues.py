"""The config tests' view of ``megarl validate``'s problems (imported by the test modules)."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def validate_issues(overrides) -> dict[str, str]:
    """``megarl validate``'s problems with ``configs/base.yaml`` plus ``overrides``: key -> its messages
    joined by `` | `` (empty when the config is valid)."""
    from megarl.config.loader import ConfigError, load_config
    from megarl.launch.preflight import preflight

    try:
        preflight(load_config(REPO / "configs" / "base.yaml", overrides))
    except ConfigError as err:
        out: dict[str, str] = {}
        for issue in err.issues:  # every message about a key, joined
            out[issue.key] = (out[issue.key] + " | " if issue.key in out else "") + str(issue)
        return out
    return {}
