"""fastft inside torchft: :class:`ManagerFFT` (a ``torchft.Manager`` on the error bus) and
:class:`BusLighthouse` (torchft's lighthouse service, told of deaths by the bus). Under
``fastft run --torchft fastft`` ManagerFFT finds the bus itself; under any other launcher,
pass ``bus=connect(store, job)``.

Needs the ``torchft`` extra: ``pip install 'fastft[torchft]'``.
"""

from fastft.integrations.torchft.lighthouse import BusLighthouse
from fastft.integrations.torchft.manager import ManagerFFT, PeerFailed
from fastft.integrations.torchft.quorum import LighthouseOptions
from fastft.integrations.torchft.replica import connect

__all__ = ["BusLighthouse", "LighthouseOptions", "ManagerFFT", "PeerFailed", "connect"]
