"""The launcher's side of the retrieval service: config checks and the search tool's URL."""
from pathlib import Path

import pytest

from megarl.cluster.retrieval import RetrievalConfigError, check_retrieval, start_retrieval
from megarl.config import load_config

REPO = Path(__file__).resolve().parents[3]


def config(*overrides):
    return load_config(REPO / "configs" / "base.yaml", list(overrides))


def test_search_tool_without_a_service_or_bad_backend_is_refused():
    with pytest.raises(RetrievalConfigError, match="rollout.tools.search needs a service"):
        check_retrieval(config("rollout.tools.search={}"))
    with pytest.raises(RetrievalConfigError, match="retrieval.backend must be one of"):
        check_retrieval(config("retrieval.backend=splade"))
    check_retrieval(config("rollout.tools.search={}", "retrieval.index=/some/index"))


def test_external_service_url_is_given_to_the_search_tool(tmp_path):
    cfg = config("rollout.tools.search={top_k: 2}", "retrieval.url=http://127.0.0.1:9")
    assert start_retrieval(cfg, tmp_path) is None  # nothing started
    assert cfg.rollout.tools.search.url == "http://127.0.0.1:9" and cfg.rollout.tools.search.top_k == 2
    kept = config("rollout.tools.search={url: 'http://127.0.0.1:7'}", "retrieval.url=http://127.0.0.1:9")
    start_retrieval(kept, tmp_path)
    assert kept.rollout.tools.search.url == "http://127.0.0.1:7"  # an explicit tool URL wins
