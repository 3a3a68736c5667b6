"""Helpers for tests, benchmarks and the CPU demo: tiny Hugging Face models made locally."""
