"""``python -m protocol_models.plan``: the dry-run planner (``protocol_models.cluster.planner``)."""

import sys

from protocol_models.cluster.planner import main

if __name__ == "__main__":
    sys.exit(main())
