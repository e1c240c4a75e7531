"""``python -m protocol_models.emulate``: a target cluster's slow link, emulated on a small machine
(``protocol_models.cluster.emulate``)."""

import sys

from protocol_models.cluster.emulate import main

if __name__ == "__main__":
    sys.exit(main())
