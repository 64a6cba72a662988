"""fastft inside torchft: :class:`ManagerFFT` (a ``torchft.Manager`` on the error bus) and
:class:`BusLighthouse` (torchft's lighthouse service, told of deaths by the bus).

Needs the ``torchft`` extra: ``pip install 'fastft[torchft]'``.
"""

from fastft.integrations.torchft.lighthouse import BusLighthouse
from fastft.integrations.torchft.manager import ManagerFFT, PeerFailed
from fastft.integrations.torchft.quorum import LighthouseOptions

__all__ = ["BusLighthouse", "LighthouseOptions", "ManagerFFT", "PeerFailed"]
