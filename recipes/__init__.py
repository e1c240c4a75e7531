"""The studies and benchmarks built on the plugin, run from a checkout's root
(``python -m recipes.NAME``; not installed with the package), and ``recipes.common``, their
shared helpers."""
