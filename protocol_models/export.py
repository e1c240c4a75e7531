"""``python -m protocol_models.export``: a run's checkpoint as an ordinary Hugging Face LLaMA
(``protocol_models.hf.export``)."""

import sys

from protocol_models.hf.export import main

if __name__ == "__main__":
    sys.exit(main())
