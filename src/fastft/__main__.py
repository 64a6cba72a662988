"""``python -m fastft``: the ``fastft`` console script."""

from fastft.cli import main

raise SystemExit(main())
