"""Cluster plumbing: Ray start and placement, the Slurm environment, engine and retrieval actors."""
