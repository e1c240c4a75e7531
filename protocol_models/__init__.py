"""Protocol Models: subspace-compressed pipeline parallelism as a TorchTitan plugin.

Importing the package first installs the CPU device shim (a no-op when an accelerator exists),
because TorchTitan binds its device type at import time.
"""

from protocol_models.tools import cpu_shim

DEVICE_TYPE = cpu_shim.install()
