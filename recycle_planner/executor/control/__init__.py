"""The control plane: who is alive, which generation runs which plan, when to stop.

Membership and leases, the pure membership decision (`protocol.decide`), the typed messages
between processes (`messages.py`), a worker's channel to all of it (`link.py`), and the
processes that run it: the single-machine launcher (`agent.py`), the coordinator of a cluster
job (`coordinator.py`) and its host agents (`hostagent.py`). Nothing here imports torch's
compute side; the data plane (`executor/data/`) never reads a control key itself.
"""
