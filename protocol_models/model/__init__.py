"""The Protocol LLaMA and its boundary methods: the model (``model``), its frozen geometry
(``subspace``), the registry of boundary methods (``boundary``), MAPL's codec (``mapl``), the
last stage's loss (``loss``) and the blocks each stage holds (``layout``). Nothing here knows
the wire, the training loop or the data."""
