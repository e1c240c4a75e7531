"""The studies and benchmarks built on the plugin; each is a script (``python recipes/NAME.py``),
and ``recipes.common`` holds their shared helpers."""
