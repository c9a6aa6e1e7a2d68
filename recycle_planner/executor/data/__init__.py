"""The data plane of one worker: process groups, the program's ops, the step, abort.

Groups of one generation and their abort (`comm.py`), the program run through a dispatch
table (`runtime.py`), one generation's groups, state copy and iterations (`generation.py`),
what crosses a stage boundary (`boundary.py`, `shapes.py`), the gradient all-reduce in buckets
(`buckets.py`), the stage's state with its undo copy and checkpoints (`state.py`, `undo.py`),
and hooks between the all-reduce and the step (`hooks.py`). It hears of membership only
through the `Decision` it is handed and the abort it is told of (`control/link.py`).
"""
