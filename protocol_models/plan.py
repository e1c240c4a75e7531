"""``python -m protocol_models.plan``: the dry-run planner (``protocol_models.cluster.plan``)."""

import sys

from protocol_models.cluster.plan import main

if __name__ == "__main__":
    sys.exit(main())
