"""Rollouts: trajectories and the engine protocol (``types.py``), the SGLang server process
(``engine_process.py``, its host / port / cores: ``engine_resources.py``, the directory it serves:
``engine_view.py``), its HTTP client (``client.py``) and router over engines (``router.py``), agent
loops (``agent.py``), tools (``tools/``), rewards (``rewards/``) and the ``RolloutManager``
(``manager.py``) that turns prompts into groups of trajectories; ``trajectory_stats.py`` reduces
them to ``rollout/*`` metrics."""
