"""The deprecated forms of ``sample`` (0.2.x; removed in 0.3.0): 0.2.0's keywords and positional order, and its
results that are not a :class:`~gpubuf.Batch`. Each call returns exactly what it returned in 0.2.0 and warns once
with a ``DeprecationWarning`` naming the new spelling (:mod:`gpubuf.replay.sampling.sample_args` states the rule);
positional arguments warn with a ``FutureWarning``, shown by default: from 0.3.0 the first one is ``batch_size``.

===========================================  ===================================================================
0.2.0                                        0.3.0
===========================================  ===================================================================
``sample(key, with_replacement, B, ...)``    ``sample(key=key, with_replacement=..., batch_size=B, ...)``
``with_next_obs=True``                       ``unit=Unit.transition()``
``frame_stack=k, frame_stride=s``            ``unit=Unit.frames(k, s)`` (``next_obs=True`` with ``with_next_obs``)
``n_step_return=(n, gamma)``                 ``unit=Unit.n_step(n, gamma)`` (``frames=k, stride=s`` with stacks)
``batch, idx = sample(return_indices=True)`` ``batch = sample(); batch.indices``
``return_generations=True``                  ``batch.indices``, ``batch.generations``
``batch, idx = per.sample()``                ``batch = per.sample(unit=...); batch.indices``
``sample(out=transition)`` returns it        ``sample(out=batch)`` returns ``batch`` (an earlier sample's)
===========================================  ===================================================================
"""

import warnings

from gpubuf.replay.sampling.batch import Batch
from gpubuf.replay.sampling.units import Unit

REMOVED_IN = "0.3.0"
# 0.2.0's positional order
POSITIONAL = ("key", "with_replacement", "batch_size", "with_next_obs", "boundaries")
# 0.2.0's keywords that 0.3.0 drops -> their defaults
KEYWORDS = {"with_next_obs": False, "return_indices": None, "frame_stack": None, "frame_stride": 1,
            "n_step_return": None, "return_generations": False}
UNIT_KEYWORDS = ("with_next_obs", "frame_stack", "frame_stride", "n_step_return")
# the caller's frame, seen from _warn: _warn <- arguments/unnamed_unit <- Samples.sample <- torch.compiler.disable
_CALLER = 5


def arguments(buffer, positional: tuple, keywords: dict, batch_size, unit, key, with_replacement, boundaries,
              out) -> tuple:
    """The arguments of the buffers' sample entry (``_sample``) that give what 0.2.0's ``buffer.sample(*positional,
    **keywords)`` returned (the other arguments given by keyword), after one warning naming the new spelling."""
    named = {"key": key, "with_replacement": with_replacement, "batch_size": batch_size, "boundaries": boundaries}
    old = {**KEYWORDS, **named, **_bind(positional, keywords, named)}
    if unit is not None:
        both = [name for name in UNIT_KEYWORDS if name in keywords or name in POSITIONAL[:len(positional)]]
        if both:
            raise ValueError(f"unit: not with {', '.join(both)} (the unit says what they said), got unit={unit!r}")
        if type(unit) is not Unit:
            raise TypeError(f"unit: expected a gpubuf.Unit or None, got {unit!r}")
        old.update(zip(UNIT_KEYWORDS, unit.args, strict=True))
    _warn(_message(buffer, positional, keywords, old, unit), FutureWarning if positional else DeprecationWarning)
    if old["with_replacement"] is None:
        old["with_replacement"] = buffer.default_with_replacement
    if old["return_indices"] is None:
        old["return_indices"] = buffer.default_return_indices
    return (old["key"], old["with_replacement"], old["batch_size"], old["with_next_obs"], old["boundaries"], out,
            old["return_indices"], old["frame_stack"], old["frame_stride"], old["n_step_return"],
            old["return_generations"])


def _bind(positional: tuple, keywords: dict, named: dict) -> dict:
    """``{name: value}`` of the 0.2.0 arguments given positionally or by dropped keyword (``TypeError`` as Python's)."""
    if len(positional) > len(POSITIONAL):
        raise TypeError(f"sample() takes at most {len(POSITIONAL)} positional arguments in its deprecated form "
                        f"({', '.join(POSITIONAL)}), got {len(positional)}")
    for name in keywords:
        if name not in KEYWORDS:
            raise TypeError(f"sample() got an unexpected keyword argument {name!r}")
    given = dict(keywords)
    for name, value in zip(POSITIONAL, positional, strict=False):
        by_keyword = named.get(name)  # None or "allow": left at its default
        if name in given or (by_keyword is not None and by_keyword != "allow"):
            raise TypeError(f"sample() got multiple values for argument {name!r}")
        given[name] = value
    return given


def _message(buffer, positional: tuple, keywords: dict, old: dict, unit) -> str:
    """The warning of a deprecated call: what it used, and what replaces it."""
    used = (["positional arguments"] if positional else []) + [f"{name}=" for name in keywords]
    instead = []
    if positional:
        names = ", ".join(f"{name}=" for name in POSITIONAL[:len(positional)] if name not in UNIT_KEYWORDS)
        instead.append(f"pass {names} by keyword (from {REMOVED_IN} the first positional argument is batch_size)")
    unit_keywords = any(name in UNIT_KEYWORDS for name in (*keywords, *POSITIONAL[:len(positional)]))
    if unit is None and (unit_keywords or buffer.default_return_indices):  # a prioritized Batch needs the unit named
        instead.append(f"pass unit={_unit_spelling(old)}")
    indices = old["return_indices"] if old["return_indices"] is not None else buffer.default_return_indices
    read = (": read batch.indices and batch.generations" if old["return_generations"]
            else ": read batch.indices" if indices else "")
    instead.append(f"the call then returns a gpubuf.Batch{read}")
    verb = "is" if len(used) == 1 and not positional else "are"
    return (f"{type(buffer).__name__}.sample: {', '.join(used)} {verb} deprecated and removed in gpubuf "
            f"{REMOVED_IN}; {'; '.join(instead)}")


def _unit_spelling(old: dict) -> str:
    """The :class:`Unit` of 0.2.0's unit keywords, as written (``Unit(...)`` for values it refuses)."""
    try:
        return repr(Unit(*(old[name] for name in UNIT_KEYWORDS)))
    except (TypeError, ValueError):
        return "Unit(...)"


def unnamed_unit(buffer, batch: Batch, out):
    """The 0.2.0 result of a call without ``unit`` that returned something other than the batch: ``(batch,
    indices)`` for a prioritized buffer, a plain ``Transition`` ``out`` itself; with the warning."""
    data = batch if out is None or type(out) is Batch else out
    notes = []
    if buffer.default_return_indices:
        notes.append(f"{type(buffer).__name__}.sample() without unit returns (batch, indices) until gpubuf "
                     f"{REMOVED_IN} and a gpubuf.Batch from then on (indices at batch.indices): name the unit, "
                     "sample(unit=gpubuf.Unit.window()), to get the Batch now")
    if data is out:
        notes.append(f"sample(out=...) with a Transition returns that Transition until gpubuf {REMOVED_IN} and a "
                     "gpubuf.Batch of its tensors from then on: pass a Batch (an earlier sample's result) as out "
                     "to get it back filled")
    _warn("; ".join(notes))
    return (data, batch.indices) if buffer.default_return_indices else data


def _warn(message: str, category: type[Warning] = DeprecationWarning) -> None:
    """``message`` as a warning from the caller's line: a ``FutureWarning`` (shown by default) where the same call
    will mean something else in 0.3.0 (positional arguments), else a ``DeprecationWarning``."""
    warnings.warn(message, category, stacklevel=_CALLER)
