"""Unit: what one drawn start of ``sample(unit=...)`` comes back as.

A start ``s`` (a flat ``row * n_envs + env``) is read as one of four units:

- ``Unit.window()`` (the default, ``unit=None``): the ``n_steps`` stored rows from ``s``; leaves ``(B, n_steps,
  ...)``, ``(B, ...)`` when ``n_steps == 1``.
- ``Unit.transition()``: the same rows, with ``next_observation`` the observation one row later (unless the buffer
  stores one); a start whose first ``n_steps`` rows hold a truncation is never drawn (a row both terminated and
  truncated is a termination: it needs no successor and is drawn).
- ``Unit.frames(k, stride=1, next_obs=False)``: pixel replay (each frame stored once, in ``observation``; no stored
  ``next_observation``): every observation leaf comes back as the stack of its row's last ``k`` frames,
  ``stride`` rows apart, oldest first, ``(B, [n_steps,] k, ...)`` (``next_observation`` too with ``next_obs``).
  At an episode start the stack is padded with the episode's first frame and never reaches a frame of the
  previous episode (an episode ends after a ``terminated`` or ``truncated`` row, or, when the buffer stores
  ``info["is_last"]``, after that row only), nor a row the ring no longer holds (its oldest frame held pads).
  Validity and probabilities of the starts are those of the plain unit.
- ``Unit.n_step(n, gamma, frames=None, stride=1)`` (a buffer of ``n_steps=1`` with a ``terminated`` leaf): the n-step
  transition: ``reward`` the discounted sum of the rewards of up to ``n`` rows from the start (float32; float64 for a
  float64 reward), ``discount`` the bootstrap value's factor ``gamma**m`` after ``m`` rewards, 0 when they end in a
  termination, ``next_observation`` the observation to bootstrap from (stacked with ``frames``), ``truncated`` True
  where fewer than ``n`` rewards were taken without a termination: at a truncation (or an ``info["is_last"]`` row) the
  return stops before that row and bootstraps from its observation; likewise before the newest row held, whose next
  observation is not stored yet. Other leaves are the start row's. Starts are drawn as for ``Unit.transition()``.

A unit checks its own values when built (``ValueError`` naming the argument, ``TypeError`` for a flag that is not a
bool); what depends on the buffer (a stack longer than the ring, returns of a buffer of windows, no observation
leaf) is checked by the sample. Units are frozen and hashable: build one once and pass it to every call.
"""

import dataclasses
import math

import numpy as np

from gpubuf._core.inputs import check_bool, positive_int


@dataclasses.dataclass(frozen=True)
class Unit:
    """What one drawn start comes back as (the module says each kind): build it with :meth:`window`,
    :meth:`transition`, :meth:`frames` or :meth:`n_step`. ``next_obs``: with ``next_observation``;
    ``frame_stack``/``frame_stride``: stacks of ``k`` frames ``stride`` rows apart (``None``: no stacks);
    ``n_step_return``: ``(n, gamma)`` (``None``: stored rewards)."""

    next_obs: bool = False
    frame_stack: int | None = None
    frame_stride: int = 1
    n_step_return: tuple[int, float] | None = None
    # (with_next_obs, frame_stack, frame_stride, n_step_return) of the buffers' sample entry
    args: tuple = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        fix = object.__setattr__  # frozen: the checked values replace the given ones once, here
        fix(self, "next_obs", check_bool("next_obs", self.next_obs))
        if self.frame_stack is not None:
            fix(self, "frame_stack", positive_int("frame_stack", self.frame_stack))
        fix(self, "frame_stride", positive_int("frame_stride", self.frame_stride))
        if self.frame_stack is None and self.frame_stride != 1:
            raise ValueError(f"frame_stride: needs frame_stack, got frame_stride={self.frame_stride!r} and "
                             "frame_stack=None")
        if self.n_step_return is not None:
            fix(self, "n_step_return", _n_step_return(self.n_step_return))
            fix(self, "next_obs", True)  # an n-step transition always carries the observation it bootstraps from
        fix(self, "args", (self.next_obs and self.n_step_return is None, self.frame_stack, self.frame_stride,
                           self.n_step_return))

    def __repr__(self) -> str:  # the constructor call that builds it
        if self.n_step_return is not None:
            n, gamma = self.n_step_return
            stack = "" if self.frame_stack is None else f", frames={self.frame_stack}"
            stride = "" if self.frame_stride == 1 else f", stride={self.frame_stride}"
            return f"Unit.n_step({n}, {gamma}{stack}{stride})"
        if self.frame_stack is not None:
            stride = "" if self.frame_stride == 1 else f", {self.frame_stride}"
            return f"Unit.frames({self.frame_stack}{stride}{', next_obs=True' if self.next_obs else ''})"
        return "Unit.transition()" if self.next_obs else "Unit.window()"

    @classmethod
    def window(cls) -> "Unit":
        """The ``n_steps`` stored rows from each start (the default)."""
        return cls()

    @classmethod
    def transition(cls) -> "Unit":
        """The ``n_steps`` rows from each start with ``next_observation``; never a start with a truncation in them."""
        return cls(next_obs=True)

    @classmethod
    def frames(cls, k: int, stride: int = 1, next_obs: bool = False) -> "Unit":
        """Observations as stacks of ``k`` frames ``stride`` rows apart (``next_observation`` too with ``next_obs``)."""
        return cls(next_obs, positive_int("k", k), positive_int("stride", stride))

    @classmethod
    def n_step(cls, n: int, gamma: float, frames: int | None = None, stride: int = 1) -> "Unit":
        """The n-step transition: up to ``n`` rewards discounted by ``gamma`` in ``[0, 1]`` (``frames``: stacked)."""
        if frames is not None:
            frames = positive_int("frames", frames)
        elif stride != 1:
            raise ValueError(f"stride: needs frames, got stride={stride!r} and frames=None")
        return cls(True, frames, positive_int("stride", stride), (positive_int("n", n), _gamma("gamma", gamma)))


def _n_step_return(value) -> tuple[int, float]:
    """``(n, gamma)`` checked: ``n`` a positive int, ``gamma`` a real number in ``[0, 1]``."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"n_step_return: expected (n, gamma), got {value!r}")
    n, gamma = value
    return positive_int("n_step_return[0]", n), _gamma("n_step_return[1]", gamma)


def _gamma(name: str, gamma) -> float:
    """``gamma`` checked as a real number in ``[0, 1]`` (``ValueError`` naming ``name``)."""
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float, np.integer, np.floating)) \
            or math.isnan(float(gamma)) or not 0.0 <= float(gamma) <= 1.0:
        raise ValueError(f"{name}: expected a discount gamma in [0, 1], got {gamma!r}")
    return float(gamma)


WINDOW = Unit()  # unit=None
