"""Prompt datasets and demonstrations: rows from jsonl / parquet or a registered loader
(``datasets.py``; GSM8K in ``gsm8k.py``), the resumable prompt sampler (``sampler.py``) and SFT
demonstrations tokenised the way rollouts are (``demonstrations.py``)."""
