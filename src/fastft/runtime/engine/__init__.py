"""The step engine: the executor that feeds the state machine and performs its actions,
and its parts: membership (votes, formations), faults (this worker's and its peers'),
the coordinator (the store side of decisions and formations), the inbox and epoch
formation (pure deciders), and the listener's store client."""
