"""``python -m protocol_models.shakespeare``: prepare the bundled Shakespeare data
(``protocol_models.data.shakespeare``)."""

from protocol_models.data.shakespeare import main

if __name__ == "__main__":
    main()
