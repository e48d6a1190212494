"""Receding-horizon planning over a HistoryBuffer: the planner (``planner``), the CEM solver (``cem``) and the
CartPole model the demo plans with (``cartpole``)."""

from gpubuf.planning.cartpole import CARTPOLE, cartpole_cost, cartpole_dynamics
from gpubuf.planning.cem import CEMSolver
from gpubuf.planning.planner import PlanConfig, Planner, check_history, takes_init

__all__ = ["CARTPOLE", "CEMSolver", "PlanConfig", "Planner", "cartpole_cost", "cartpole_dynamics",
           "check_history", "takes_init"]
