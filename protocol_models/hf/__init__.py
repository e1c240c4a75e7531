"""After training: a run's checkpoint as an ordinary Hugging Face LLaMA, and what reads it. The
checkpoint read on the CPU (``checkpoint_files``), the constraint folded away (``fold``), the HF
layout (``hf_llama``), ``export``, the model the commands read (``hf_model``), ``evaluate``,
``generate`` and their argument errors (``cli``). What a checkpoint means is the run record
the trainer writes (``protocol_models.training.run_record``)."""
