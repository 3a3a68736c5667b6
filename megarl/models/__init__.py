"""Models megarl builds itself: ``tiny:`` random models for CPU runs, tests and demos (:mod:`megarl.models.tiny`)."""
