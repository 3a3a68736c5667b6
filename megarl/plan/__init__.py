"""Capacity planning on paper (``megarl plan``): memory per trainer and engine rank, step time and
weight-sync seconds, from a model's ``config.json`` alone.

Layering: this package sits below ``launch`` and ``cli``; :mod:`megarl.plan.gpus` and
:mod:`megarl.plan.memory` import nothing from megarl at all (``config/validate.py`` calls them),
:mod:`megarl.plan.report` takes what it needs from higher layers (the weight-sync prediction, the
data plan) as arguments.
"""
