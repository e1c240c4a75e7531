"""``python -m protocol_models.evaluate``: held-out loss and perplexity of a trained model
(``protocol_models.hf.evaluate``)."""

import sys

from protocol_models.hf.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
