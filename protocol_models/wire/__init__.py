"""The wire: everything between two pipeline stages.

* ``codecs``: the lossy boundary codecs (a registry, ``CODECS``) and their in-graph form;
* ``stage``: ``WirePipelineStage``, whose send/recv op builders are where the wire is hooked;
* ``meter``: the bytes each stage sends, per boundary and direction;
* ``message``: one packed message per microbatch and direction;
* ``link``: the slow-link simulator (``[wan]``);
* ``transport``: receive posting (``[transport]``) and the TCP settings a long link needs;
* ``async_schedule``, ``weight_versions``: the asynchronous ``Async1F1B`` schedule and the two
  weight versions its stages forward with;
* ``sizes``: the one size model of a boundary message, for every mode;
* ``pipeline``: the model spec's pipelining and parallelize functions, which split the model
  into stages and put the wire between them.

``Wire`` bundles the parts one run uses, built once from its config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from protocol_models.model.boundary import BOUNDARIES
from protocol_models.wire.codecs import CODECS, Codec, build_codec
from protocol_models.wire.link import SimulatedLink
from protocol_models.wire.meter import WireMeter, ring_rounds
from protocol_models.wire.rvq import ResidualVQ


def modes() -> list[str]:
    """Every ``[protocol] mode``: the boundary methods (``protocol_models.model.boundary``: the wire
    carries the stage output as it is), then the registered lossy codecs."""
    return [*BOUNDARIES, *CODECS]


def codec_for(config) -> Codec | None:
    """The codec on ``config``'s boundary messages: MAPL's residual vector quantizer with
    ``[protocol] rvq_stages`` > 0, else ``build_codec`` of the mode and ``[codec]``."""
    protocol = config.protocol
    if protocol.mode == "mapl" and protocol.rvq_stages:
        return ResidualVQ(protocol.rvq_stages, protocol.rvq_codebook)
    return build_codec(protocol.mode, config.codec, config.model.dim, protocol.seed)


@dataclass
class Wire:
    """The wire parts of one run (one of each, built once): the meter every stage counts into,
    the lossy codec of the mode (None: exact) used at the transport hook of a pipelined run or
    in-graph in a single-process run, the slow-link simulator (None: ``[wan]`` off), and
    whether stages pre-post their receives (``[transport] prepost_receives``); the pipeline
    stages this rank runs register themselves in ``stages``."""

    meter: WireMeter
    codec: Codec | None
    link: SimulatedLink | None
    prepost: bool = True
    async_hop: int = 1
    """The ``Async1F1B`` schedule's hop depth (``[transport] async_hop_depth``)."""
    timeout: timedelta | None = None
    """The start-up timeout of the groups the wire creates (``[comm] init_timeout_seconds``;
    the trainer sets the train timeout after the first step)."""
    stages: list = field(default_factory=list)
    """The ``wire.stage.WirePipelineStage`` objects of this rank (not imported here: the stage
    module imports this one)."""

    def collective(self, purpose: str, kind: str, ranks: int) -> None:
        """A ring ``kind`` collective over the ``ranks`` pipeline stages just ran, for
        ``purpose``: the meter counts it and the simulated link (if any) charges its rounds."""
        rounds = ring_rounds(kind, ranks)
        self.meter.collective(purpose, rounds)
        if self.link is not None:
            self.link.collective(rounds)

    @classmethod
    def from_config(cls, config) -> Wire:
        """The parts ``config`` (a ``ProtocolTrainer.Config``) asks for."""
        return cls(
            meter=WireMeter(dim=config.model.dim),
            codec=codec_for(config),
            link=SimulatedLink(config.wan) if config.wan.enabled else None,
            prepost=config.transport.prepost_receives,
            async_hop=config.transport.async_hop_depth,
            timeout=timedelta(seconds=config.comm.init_timeout_seconds),
        )


__all__ = ["Wire", "codec_for", "modes"]
