"""``python -m protocol_models.pilot_basis``: a data-driven U for ``[protocol] basis_file``, the
principal subspace of a trained run's boundary stream (``protocol_models.hf.pilot_basis``)."""

import sys

from protocol_models.hf.pilot_basis import main

if __name__ == "__main__":
    sys.exit(main())
