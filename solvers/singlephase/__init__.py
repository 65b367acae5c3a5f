"""Solvers for single-phase problems (no backward, :attr:`solvers.Problem.single_phase`).

The random layered graphs of the Checkmate / Moccasin / FastSA benchmarks run in a fixed
order, and any value may be recomputed before any later step, as often as pays:

* :mod:`~solvers.singlephase.anywhere`: the exact interval model on CP-SAT (Moccasin's
  problem), and the solve that runs the others around it;
* :mod:`~solvers.singlephase.local`: the ruin-and-recreate search that finds its first plan;
* :mod:`~solvers.singlephase.window`: exact re-solves of windows of steps, the rest fixed;
* :mod:`~solvers.singlephase.bound`: a lower bound over every plan, for the gap.

:mod:`solvers.cpsat` (two-phase problems) never imports this package; :mod:`solvers.planner`
picks between the two. This package imports no other solver.
"""
