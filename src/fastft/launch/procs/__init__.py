"""The agent's processes: its workers' lives (start, exit, output), the fork server and the warm spares, and seeing a worker's death at its start."""
