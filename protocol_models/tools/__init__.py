"""What every layer may use, as TorchTitan's ``tools``: the user-facing errors (``errors``), the
CPU device shim a CPU worker installs at launch, before any TorchTitan import that reads the
device (``cpu_shim``), and two facts
about this node (``cuda_driver``: the NVIDIA driver; ``interfaces``: the network interface)."""
