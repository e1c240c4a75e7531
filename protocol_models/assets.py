"""``python -m protocol_models.assets``: fetch a tokenizer from the Hugging Face Hub
(``protocol_models.data.assets``)."""

import sys

from protocol_models.data.assets import main

if __name__ == "__main__":
    sys.exit(main())
