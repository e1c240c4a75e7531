"""``python -m protocol_models.generate``: continue a prompt with a trained model
(``protocol_models.hf.generate``)."""

import sys

from protocol_models.hf.generate import main

if __name__ == "__main__":
    sys.exit(main())
