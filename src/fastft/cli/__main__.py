"""``python -m fastft.cli``."""

from fastft.cli import main

raise SystemExit(main())
