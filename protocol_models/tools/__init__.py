"""What every layer may use, as TorchTitan's ``tools``: the user-facing errors (``errors``), the
CPU device shim the package installs before any TorchTitan import (``cpu_shim``), and two facts
about this node (``cuda_driver``: the NVIDIA driver; ``interfaces``: the network interface)."""
