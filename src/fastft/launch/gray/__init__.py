"""Gray failures: link probes between nodes, stragglers, and the verdicts peers publish about a worker."""
