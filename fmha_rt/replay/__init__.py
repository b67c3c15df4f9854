"""Calls replayed by C: the launch-program model (program.py), the plan cache of repeated public calls
(plan_cache.py) and the launch programs of the XLA handler (xla_program.py)."""
