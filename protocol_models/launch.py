"""``python -m protocol_models.launch``: torchrun for this plugin
(``protocol_models.cluster.launch``)."""

import sys

from protocol_models.cluster.launch import main

if __name__ == "__main__":
    sys.exit(main())
