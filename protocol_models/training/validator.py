"""TorchTitan's Validator for a Protocol LLaMA: token ids (and the other stage kwargs) reach every
stage, and each validation ends with the ``[metrics]`` sampled continuations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torchtitan.components.validate import Validator

from protocol_models.tools.ranges import AT_LEAST_1, Range, Ranges
from protocol_models.training.samples import sample_at_validation
from protocol_models.training.stage_kwargs import add_protocol_kwargs


class ProtocolValidator(Validator):
    """TorchTitan's Validator, passing token ids to every stage; then ``[metrics]`` samples."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        RANGES: ClassVar[Ranges] = {
            "freq": AT_LEAST_1,
            "steps": Range(low=1, also=(-1,), note="-1 = the whole validation data"),
        }

    def post_dataloading_process(self, input_dict, labels, model_parts):
        inputs, labels, extra = super().post_dataloading_process(input_dict, labels, model_parts)
        return inputs, labels, add_protocol_kwargs(inputs, labels, extra, model_parts[0].config)

    def validate(self, model_parts, step: int) -> None:
        super().validate(model_parts, step)
        sample_at_validation(self, model_parts, step)  # [metrics] sample_prompts


__all__ = ["ProtocolValidator"]
