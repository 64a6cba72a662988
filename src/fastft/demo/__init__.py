"""``fastft demo``: a small data-parallel job that survives one fault of each kind."""
