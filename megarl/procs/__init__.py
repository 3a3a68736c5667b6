"""Local multi-process utilities: run N ranks of a function on this host (conversion, tests)."""
