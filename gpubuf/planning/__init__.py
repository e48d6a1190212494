"""Receding-horizon planning over a HistoryBuffer: the planner, the CEM solver and the CartPole model the
demo plans with."""

from gpubuf.planning.planner import (
    CARTPOLE,
    CEMSolver,
    PlanConfig,
    Planner,
    cartpole_cost,
    cartpole_dynamics,
    check_history,
    takes_init,
)

__all__ = ["CARTPOLE", "CEMSolver", "PlanConfig", "Planner", "cartpole_cost", "cartpole_dynamics",
           "check_history", "takes_init"]
