"""`python -m recycle_planner.executor FILE.py:FUNCTION [ARGS...]`: the worker entry point the
launcher starts for a job given as a factory."""

from recycle_planner.executor.worker import main

main()
