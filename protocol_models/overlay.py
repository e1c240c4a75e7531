"""``python -m protocol_models.overlay``: a WireGuard overlay's configs for a run's nodes
(``protocol_models.cluster.overlay``)."""

import sys

from protocol_models.cluster.overlay import main

if __name__ == "__main__":
    sys.exit(main())
