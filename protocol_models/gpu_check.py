"""``python -m protocol_models.gpu_check``: a short real run of a layout on a GPU node, measured
against the planner (``protocol_models.cluster.gpu_check``)."""

import sys

from protocol_models.cluster.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
