"""Detectors: pure numpy/scipy, one interface (see ``base``), no Kafka or Faust."""

from stream_processors.detectors.base import Detector
from stream_processors.detectors.nonfinite import NonFinite
from stream_processors.detectors.spike import RobustSpike

__all__ = ["Detector", "NonFinite", "RobustSpike"]
