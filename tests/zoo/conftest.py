"""The zoo: ordinary training scripts (tests/zoo/*.py) under ``fastft run`` and fault plans."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
