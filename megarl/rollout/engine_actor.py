"""A Ray actor per rollout engine (cluster mode): it starts an SGLang server on its node.

The actor is thin on purpose: it owns one :class:`~megarl.rollout.engine.EngineProcess` on the node
Ray placed it on, and reports the URL the driver's :class:`~megarl.rollout.client.SGLangClient`
should use. Generation traffic goes straight to that URL over HTTP, never through Ray.

Usage (the launch layer does this)::

    actor = ray.remote(num_gpus=tp_size)(EngineActor).remote(model_path, tp_size=tp_size, host="0.0.0.0")
    url = ray.get(actor.start.remote(timeout_s=600))

Ray sets ``CUDA_VISIBLE_DEVICES`` for the actor; the server process inherits it.
"""
from __future__ import annotations

import os
from typing import Any

from megarl.rollout.engine import EngineProcess

_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class EngineActor:
    """Body of the Ray actor that owns one SGLang server process on its node.

    Args:
        model_path: model directory, readable on the actor's node.
        **engine_kwargs: :class:`EngineProcess` arguments (``port``, ``host``, ``tp_size``,
            ``device``, ``extra_args``, ``log_path`` ...).
    """

    def __init__(self, model_path: str | os.PathLike, **engine_kwargs: Any) -> None:
        self.engine = EngineProcess(model_path, **engine_kwargs)

    def start(self, timeout_s: float = 600.0) -> str:
        """Start the server, wait until healthy, and return its URL as seen from other nodes.

        Raises:
            megarl.rollout.engine.EngineStartupError: with the server's log tail.
        """
        self.engine.start().wait_healthy(timeout_s)
        return self.url()

    def url(self) -> str:
        """``http://<node address>:<port>``: the node's IP when the server binds a wildcard."""
        host = self.engine.host
        if host in _WILDCARD_HOSTS:
            import ray

            host = ray.util.get_node_ip_address()
        return f"http://{host}:{self.engine.port}"

    def health(self) -> bool:
        """The server answers ``/health``."""
        return self.engine.is_alive() and self.engine.health()

    def restart(self, timeout_s: float = 600.0) -> str:
        """Restart the server on the same port (launch weights; re-sync before use); URL."""
        self.engine.restart(timeout_s)
        return self.url()

    def kill(self) -> None:
        """SIGKILL the server (fault-injection in tests)."""
        self.engine.kill()

    def stop(self) -> None:
        """Stop the server."""
        self.engine.stop()

    def log_tail(self) -> str:
        """The end of the server log (for the driver's error messages)."""
        return self.engine.log_tail()
