"""What a run reads: the loader (``loader``: any corpus -> packed token ids), the corpora a
``[dataloader]`` table names (``corpus``), the bundled Shakespeare data (``shakespeare``,
prepared as any text corpus is by ``prepared``) and tokenizers fetched from the Hugging Face Hub
(``assets``)."""
