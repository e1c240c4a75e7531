"""Protocol Models: subspace-compressed pipeline parallelism as a TorchTitan plugin.

Importing the package changes nothing in TorchTitan or torch. A worker that trains on the CPU
binds TorchTitan to it explicitly at launch (``protocol_models.tools.cpu_shim.install``, which
``protocol_models.train`` calls before it imports any TorchTitan module that reads the device).
"""
