"""A private single-host Ray instance for a test (tests/integration)."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any


def one_auth_mode() -> str:
    """Fix Ray's authentication mode for this process (``RAY_AUTH_MODE``, ``disabled`` unless already
    set) before it starts or joins an instance, and never change it afterwards; returns the mode.

    Ray 2.60 reads the mode twice: its C++ config caches it in the driver (``Config.initialize``), and
    each GCS it starts reads its own environment. A ``ray.init`` that starts an instance with the
    variable unset sets it to ``token`` in ``os.environ`` when ``~/.ray/auth_token`` exists
    (``authentication_token_setup.enable_token_auth_by_default``); a helper that set ``disabled`` for
    one cluster and restored ``token`` after left the next instance's GCS requiring a token the
    driver, cached ``disabled``, never sent (``AuthenticationError: InvalidAuthToken``) in one long
    pytest process. One value for the whole process, as :func:`megarl.cluster.placement.init_ray`
    keeps (``setdefault``), makes driver and servers agree.
    """
    import os

    return os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@contextlib.contextmanager
def private_ray(**init_kwargs: Any) -> Iterator[None]:
    """Start Ray on 127.0.0.1 (megarl's loopback switch, `megarl.cluster.placement.LOCAL_RAY_LOOPBACK_ENV`),
    yield, shut it down; the switch and the environment are restored right after ``ray.init``.

    Args:
        init_kwargs: ``ray.init`` arguments (``num_cpus``, ``num_gpus`` logical devices, ...).

    Raises:
        pytest.skip.Exception: a Ray instance is already running in this process.
    """
    import pytest
    import ray
    from ray._private import ray_constants

    from megarl.cluster.placement import LOCAL_RAY_LOOPBACK_ENV

    if ray.is_initialized():
        pytest.skip("a Ray instance is already running in this process")
    one_auth_mode()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LOCAL_RAY_LOOPBACK_ENV, "0")
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING,  # never another's
                 runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}}, **init_kwargs)
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def private_ray_cluster(head: dict[str, Any], nodes: list[dict[str, Any]]) -> Iterator[Any]:
    """A private Ray cluster of several nodes on this machine (``ray.cluster_utils.Cluster``), every
    raylet on 127.0.0.1, this process connected to it; shut down on exit.

    Args:
        head: the head node's ``add_node`` arguments (``num_cpus``, ``num_gpus`` logical devices,
            ``resources``); the dashboard is off.
        nodes: each further node's ``add_node`` arguments.

    Yields:
        The ``Cluster``.

    Raises:
        pytest.skip.Exception: a Ray instance is already running in this process.
    """
    import pytest
    import ray
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    from megarl.cluster.placement import LOCAL_RAY_LOOPBACK_ENV

    if ray.is_initialized():
        pytest.skip("a Ray instance is already running in this process")
    one_auth_mode()
    with pytest.MonkeyPatch.context() as mp:  # every raylet on 127.0.0.1 (megarl.cluster.placement)
        mp.setenv(LOCAL_RAY_LOOPBACK_ENV, "0")
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        cluster = Cluster(initialize_head=True, head_node_args={"include_dashboard": False, **head})
        try:
            for node in nodes:
                cluster.add_node(**node)
            ray.init(address=cluster.address, logging_level=logging.WARNING,
                     runtime_env={"env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}})
            cluster.wait_for_nodes()
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()
