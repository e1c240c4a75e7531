"""``python -m protocol_models.config --toml FILE [overrides]``: check a config
(``protocol_models.config.run_config``)."""

import sys

from protocol_models.config.run_config import main

sys.exit(main())
