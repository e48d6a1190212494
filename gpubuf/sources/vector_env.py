"""A gymnasium vector env driver that feeds the buffers.

:class:`VectorEnvSource` steps any gymnasium 1.x ``VectorEnv`` (``SyncVectorEnv``, ``AsyncVectorEnv``, an env's own
vectorized implementation) and writes its rows by the row convention of :mod:`gpubuf.sources.rows`, the one
:class:`~gpubuf.EnvPoolSource` writes, whatever the env's ``metadata["autoreset_mode"]``:

- ``NEXT_STEP`` (gymnasium's default, EnvPool's way): the step after an episode end ignores its action and returns the
  reset frame. The rows are the env's outputs as they come.
- ``SAME_STEP``: the step that ends an episode returns the reset frame and puts the final observation in
  ``info["final_obs"]``. The source writes the final observation (with the step's reward and flags, and
  ``info["final_info"]``'s fields) as that env's row, then the reset frame as the next row of that env, as if the env
  had spent a step on the reset (the history too: the final observation, then the reset frame, which flushes it with
  its episode: no ``get()`` returns a final observation).
- ``DISABLED``: the source resets the envs that ended, through ``env.reset(options={"reset_mask": ended})``, right after
  the step, and writes the same rows as for ``SAME_STEP``.

So in the two same-step modes an episode end yields two rows of one env in one step (its final observation and its reset
frame): a buffer with ``vectorized_env=False`` gets both; a vectorized buffer gets one row per env per step without
``info["is_last"]`` rows and does not store the final observation (``last`` holds it with ``SAME_STEP``; what that
costs: :mod:`gpubuf.sources.rows`). With ``NEXT_STEP`` a vectorized buffer holds EnvPool's rows."""

import warnings

import numpy as np

from gpubuf._core.concurrency import locked
from gpubuf._core.copies import refuse_copies
from gpubuf.sources.actions import check_action_space
from gpubuf.sources.layout import exact_info, example_info_spec
from gpubuf.sources.source import RowSource
from gpubuf.sources.staging import Step

__all__ = ["VectorEnvSource"]

MODES = ("NextStep", "SameStep", "Disabled")  # gymnasium's AutoresetMode values


def autoreset_mode(env) -> str:
    """The env's ``metadata["autoreset_mode"]`` as one of :data:`MODES` (``NextStep`` when unset, as gymnasium's)."""
    mode = (getattr(env, "metadata", None) or {}).get("autoreset_mode", "NextStep")
    value = getattr(mode, "value", mode)
    if value not in MODES:
        raise ValueError(f"env: metadata['autoreset_mode'] must be one of gymnasium's {MODES}, got {mode!r}")
    return value


@refuse_copies("it drives a live vector env; make a new source in the other process and copy its buffers "
               "(state_dict) there")
class VectorEnvSource(RowSource):
    """Steps a gymnasium vector env and hands every row to the buffers as device tensors.

    Args:
        env: a gymnasium 1.x ``VectorEnv`` (``gymnasium.make_vec(...)``, ``SyncVectorEnv``, ``AsyncVectorEnv``) with an
            array observation space (``Box``, ``Discrete``, ``MultiBinary``, ``MultiDiscrete``).
        obs_key, device, history, transitions: as for :class:`~gpubuf.EnvPoolSource` (a ``history`` over
            ``env.num_envs`` envs).
        info_keys: ``{name: example}``: fields of the env's ``info`` to store, each with one env's example value (its
            shape and dtype), e.g. ``{"x_position": np.float64(0)}``; appended to the history under their own names
            and stored in the transitions as ``info[name]``, the value the env reported with the row's observation (0
            where the env's ``info["_name"]`` mask says it reported none), in the example's dtype where no value
            changes (``docs/dtypes.md``; else ``ValueError`` naming the field, before anything is written).
        action_fill: the action stored on every row whose action the env ignored (reset frames), as for
            :class:`~gpubuf.EnvPoolSource` (default: NaN for float actions, -1 for signed integer ones).

    Rows per autoreset mode: the module docstring. Actions outside a ``Box`` are clipped to it before they are sent, so
    the buffers store what the env executed.

    ``step = src.reset(seed=0); step = src.step(actions)``; :attr:`last` holds the env's own outputs of the last call
    (``(obs, reward, terminated, truncated, info)``; ``(obs, info)`` after a reset), for episode statistics.

    Threads: one call at a time runs; copies and pickles are refused (the env cannot be copied)."""

    def __init__(self, env, *, obs_key: str = "observation", device=None, history=None, transitions=None,
                 info_keys=None, action_fill=None):
        from gymnasium.vector import VectorEnv

        if not isinstance(env, VectorEnv):
            raise TypeError(f"env: expected a gymnasium VectorEnv (gymnasium.make_vec(...)), got {type(env).__name__}")
        check_action_space(env.single_action_space, "env")
        obs_space = env.single_observation_space
        if not hasattr(obs_space, "dtype") or obs_space.dtype is None or getattr(obs_space, "shape", None) is None:
            raise TypeError(f"env: expected an array observation space (Box, Discrete, ...), got {obs_space}")
        self.env = env
        self.autoreset_mode = autoreset_mode(env)
        spec = example_info_spec({} if info_keys is None else info_keys, obs_key)
        self.info_keys = dict(info_keys or {})
        same_step = self.autoreset_mode != "NextStep"
        super().__init__(int(env.num_envs), env.single_action_space, obs_space, obs_key=obs_key, device=device,
                         action_fill=action_fill, info_spec=spec, ends_in_step=same_step)
        self._order = np.arange(self.n_envs, dtype=np.int64)
        self._ended = np.zeros(self.n_envs, dtype=bool)  # NEXT_STEP: the env's last step ended an episode
        self._zeros = np.zeros(self.n_envs, dtype=np.float32)
        self._no = np.zeros(self.n_envs, dtype=bool)
        self._started = False
        self._unreported = set()  # info_keys the env has not reported yet (warned once each)
        self.last = None
        self.history = history
        self.transitions = transitions

    # ------------------------------------------------------------------ stepping

    @locked
    def reset(self, seed=None, options=None) -> Step:
        """Reset every env (``env.reset(seed=seed, options=options)``); returns the reset frames. With a vectorized
        ``transitions`` buffer that holds rows, each env's last observation is first written as an ``is_last`` row."""
        self._rows.restart()
        obs, info = self.env.reset(seed=seed, options=options)
        self.last = (obs, info)
        self._ended[:] = False
        self._started = True
        return self._rows.receive(obs, self._zeros, self._no, self._no, self._order, ~self._no,
                                  self._actions.zeros((self.n_envs,)), self._infos(info), True)

    @locked
    def step(self, actions, extra=None) -> Step:
        """Step every env with ``actions`` (``(n_envs,)`` for discrete, ``(n_envs, *shape)``; checked and clipped as
        :meth:`gpubuf.EnvPoolSource.send` does) and write the rows; returns the rows of the envs' current
        observations (after an episode end in a same-step mode: the reset frame). ``extra``: ``{name: (n_envs, ...)}``
        per-env data for the transitions buffer's own ``info`` leaves. A bad input raises before the env steps."""
        if not self._started:
            raise RuntimeError("step: reset() the source first")
        acts = self._actions.host(actions, self.n_envs)
        extras = None if extra is None and not self._extra.spec else self._extra.check(extra, self.n_envs)
        out = self.env.step(acts)
        self.last = out
        if extras:
            self._extra.store(extras)
        try:
            return self._write(acts, *out)
        except Exception as err:  # the env stepped but its rows were not all written: the pending rows are stale
            self._started = False
            if err.args and isinstance(err.args[0], str):
                err.args = (f"{err.args[0]} (the env stepped, but its outputs could not be written: reset() the "
                            "source before the next step)", *err.args[1:])
            raise

    def _write(self, acts, obs, reward, terminated, truncated, info) -> Step:
        """Write the rows of one env step (the env's outputs as it returned them)."""
        out = (obs, reward, terminated, truncated, info)
        terminated, truncated = np.asarray(terminated, dtype=bool), np.asarray(truncated, dtype=bool)
        reward = np.asarray(reward)
        obs = np.ascontiguousarray(obs)  # e.g. CartPole's own vector env returns a transposed view; staged as is
        if self.autoreset_mode == "NextStep":
            first, self._ended = self._ended, terminated | truncated
            return self._rows.receive(obs, reward, terminated, truncated, self._order, first, acts, self._infos(info),
                                      True)
        ended = terminated | truncated
        final, final_info = None, {}
        if np.count_nonzero(ended):
            ids = np.flatnonzero(ended)
            if self.autoreset_mode == "SameStep":
                final, final_info = np.stack([info["final_obs"][i] for i in ids]), info.get("final_info", {})
            else:  # DISABLED: the step's observations are the final ones; reset the envs that ended
                final, final_info = obs[ids], info
                obs, reset_info = self.env.reset(options={"reset_mask": ended})
                obs = np.ascontiguousarray(obs)
                info = _merged(info, reset_info, ended)  # the reset envs' info from the reset, others' from the step
                self.last = (obs, *out[1:4], info)
            final_info = self._infos(final_info, ids)
        return self._rows.receive_ends_in_step(obs, reward, terminated, truncated, acts, self._infos(info), final,
                                               final_info)

    def _infos(self, info: dict, ids: np.ndarray | None = None) -> dict:
        """``{key: (R, *shape)}`` host arrays of the stored info fields (rows ``ids`` of the env's batched ``info``;
        all when ``None``), 0 where the env reported none."""
        out = {}
        for key, (shape, dtype) in self._info_spec.items():
            n = self.n_envs
            a = np.zeros((n, *shape), dtype=dtype)
            if key in info:
                values = np.asarray(info[key])
                if values.shape != (n, *shape):
                    raise ValueError(f"info_keys: the env's {key!r} came as {values.dtype} {values.shape}, expected "
                                     f"{dtype} {(n, *shape)}")
                mask = np.asarray(info.get(f"_{key}", np.ones(n, dtype=bool)), dtype=bool)
                try:
                    a[mask] = exact_info(values[mask], dtype, f"info[{key!r}]")
                except TypeError as err:
                    raise ValueError(f"info_keys: the env's {key!r} values ({values.dtype}) do not fit the example's "
                                     f"dtype {dtype} exactly ({err}); give an example of their dtype") from None
            elif key not in self._unreported:
                self._unreported.add(key)
                warnings.warn(f"info_keys: the env reported no {key!r} in its info; stored as 0 until it does",
                              stacklevel=4)
            out[key] = a if ids is None else a[ids]
        return out


def _merged(step_info: dict, reset_info: dict, reset: np.ndarray) -> dict:
    """The batched info of a step whose ``reset`` envs were reset after it: theirs from ``reset_info``."""
    out = dict(step_info)
    for key, value in reset_info.items():
        if key.startswith("_") or f"_{key}" not in reset_info:
            continue
        mask = np.asarray(reset_info[f"_{key}"], dtype=bool) & reset
        if key in out:
            merged = np.array(out[key], copy=True)
            merged[mask] = np.asarray(value)[mask]
        else:
            merged = value
        out[key] = merged
        out[f"_{key}"] = np.asarray(out.get(f"_{key}", np.zeros_like(reset)), dtype=bool) | mask
    return out
