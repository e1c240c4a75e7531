"""The strict TOML layer: TOML files and overrides (``toml_tables``), the run's config built and
checked from them (``run_config``), the checks against this machine (``preflight``), and the
config check, ``python -m protocol_models.config`` (``__main__``)."""
