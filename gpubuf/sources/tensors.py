"""A source for simulators whose loop hands over per-step tensors (GPU simulators, JAX envs through DLPack).

:class:`TensorSource` takes what a batched simulator's step returns (observation, reward, terminated, truncated, and
when it has one the final observation of each episode that ended) and writes the rows by the row convention of
:mod:`gpubuf.sources.rows`. Such simulators reset an env inside the step that ends its episode (Isaac Lab, ManiSkill3,
MuJoCo Playground, Brax, gymnax): the observation they return for that env is already the next episode's reset frame.

- A vectorized buffer (build it from :meth:`transition_sample`), with or without final observations: one row per env
  per step without ``info["is_last"]``, episodes ending at ``terminated | truncated`` rows, a final observation stored
  nowhere (what that costs: :mod:`gpubuf.sources.rows`; a terminated row's ``next_observation`` is the next episode's
  first frame, which a world model should mask with ``terminated``).
- A buffer with ``vectorized_env=False`` (``final_obs=True`` only): the final observation is written as that env's row,
  then the reset frame (as :class:`~gpubuf.VectorEnvSource` does for gymnasium's SAME_STEP mode), every transition with
  its real successor.

Observations stay where they come (a CUDA tensor is staged in place, no copy); the episode-end flags, rewards, actions
and info fields are read to the host once per step (one device synchronisation per step on CUDA), where the history's
resets and the buffers' episode bookkeeping live. Values are stored as the simulator gives them, cast to the buffers'
dtypes only where no value changes (``docs/dtypes.md``: bool or integer observations into a float space, bool or integer
rewards into float32, info fields into their example's dtype, float64 rounded into float32); a cast that would change a
value (1.7 or NaN into an integer field, 300 into ``uint8``) raises ``TypeError`` naming the argument before anything is
written. NaN observations and rewards are stored as they are (a diverged simulator's output is the caller's to filter),
while non-finite actions are refused."""

import numpy as np
import torch

from gpubuf._core.concurrency import locked
from gpubuf._core.copies import refuse_copies
from gpubuf._core.inputs import as_tensor, check_bool, check_cast, positive_int
from gpubuf.sources.actions import check_action_space
from gpubuf.sources.device_steps import DeviceSteps
from gpubuf.sources.layout import exact_info, example_info_spec
from gpubuf.sources.source import RowSource
from gpubuf.sources.staging import Step

__all__ = ["TensorSource"]


def host_array(value, name: str) -> np.ndarray:
    """``value`` (numpy, a torch tensor on any device, a ``__dlpack__`` array, a scalar list) as a host numpy array."""
    if isinstance(value, np.ndarray):
        return value
    t = as_tensor(value, name)
    return t.detach().cpu().numpy()


@refuse_copies("it holds a simulator run's pending rows; make a new source in the other process and copy its buffers "
               "(state_dict) there")
class TensorSource(RowSource):
    """Writes the per-step tensors of a batched simulator into the buffers.

    Args:
        n_envs: the simulator's batch of envs.
        observation_space: one env's observation space (``shape``, numpy ``dtype``; a gymnasium ``Box`` or any object
            with them).
        action_space: one env's action space (``dtype``, ``shape``; ``Discrete``'s ``n``; a ``Box``'s bounds clip the
            stored actions, as the simulator should apply them).
        final_obs: whether :meth:`step` gets each ended episode's final observation (module docstring).
        obs_key, device, history, transitions, action_fill: as for :class:`~gpubuf.EnvPoolSource`.
        info_keys: ``{name: example}`` per-step info fields to store (one env's example value: shape and dtype),
            passed to :meth:`step` as ``infos={name: (n_envs, ...)}``, stored in the example's dtype where no value
            changes (else ``TypeError`` naming ``infos[name]``).
        capturable: :meth:`step` reads nothing back from the device, so a loop calling it can be traced whole by
            ``torch.compile(fullgraph=True)`` or captured in a CUDA graph (:mod:`gpubuf.sources.device_steps`:
            ``final_obs=False``, a vectorized ``transitions`` buffer and a ``history`` written through their
            ``graph_writer()``, no info fields or extra data; value checks on the device; ``Step.first`` a device
            tensor).

    ``step = src.reset(obs)``, then per simulator step ``step = src.step(actions, obs, reward, terminated, truncated,
    final_obs=...)`` with the actions that produced them. Threads: one call at a time; copies and pickles are refused.
    """

    def __init__(self, n_envs: int, observation_space, action_space, *, final_obs: bool, obs_key: str = "observation",
                 device=None, history=None, transitions=None, info_keys=None, action_fill=None, capturable=False):
        n_envs = positive_int("n_envs", n_envs)
        if not isinstance(final_obs, bool):
            raise TypeError(f"final_obs: expected True or False, got {final_obs!r}")
        for name, space in (("observation_space", observation_space), ("action_space", action_space)):
            if getattr(space, "dtype", None) is None or getattr(space, "shape", None) is None:
                raise TypeError(f"{name}: expected a space with a shape and a numpy dtype (e.g. a gymnasium Box), got "
                                f"{type(space).__name__}")
        check_action_space(action_space, "action_space")
        spec = example_info_spec({} if info_keys is None else info_keys, obs_key)
        self.final_obs = final_obs
        super().__init__(int(n_envs), action_space, observation_space, obs_key=obs_key, device=device,
                         action_fill=action_fill, info_spec=spec, has_final_obs=final_obs, ends_in_step=True)
        self._obs_shape = tuple(observation_space.shape)
        self._obs_dtype = torch.from_numpy(np.zeros(0, observation_space.dtype)).dtype
        self._no = np.zeros(self.n_envs, dtype=bool)
        self._zeros = np.zeros(self.n_envs, dtype=np.float32)
        self._started = False
        self.history = history
        self.transitions = transitions
        self._device_steps = None
        if check_bool("capturable", capturable):
            if final_obs:
                raise ValueError("final_obs: a capturable TensorSource writes a vectorized buffer, which stores no "
                                 "final observation; build it with final_obs=False")
            if spec:
                raise ValueError(f"info_keys: a capturable TensorSource stores no info fields, got {sorted(spec)}")
            self._device_steps = DeviceSteps(self, self._rows, self._actions, self._obs_shape, self._obs_dtype)

    @locked
    def reset(self, obs, infos=None) -> Step:
        """Start every env from ``obs`` ``(n_envs, *obs)`` (reset frames); with a vectorized ``transitions`` buffer
        holding rows, each env's pending observation first ends its episode."""
        self._check_obs(obs, "obs")
        infos = self._infos(infos)
        if self._device_steps is not None:
            self._device_steps.check()
        self._rows.restart()
        self._started = True
        step = self._rows.receive(obs, self._zeros, self._no, self._no, self.stager.all_ids, ~self._no,
                                  self._actions.zeros((self.n_envs,)), infos, True)
        if self._device_steps is not None:
            self._device_steps.bind()
        return step

    @locked
    def step(self, actions, obs, reward, terminated, truncated, final_obs=None, infos=None, extra=None) -> Step:
        """Write one simulator step: ``actions`` ``(n_envs, ...)`` that were executed (checked; a ``Box`` clips them),
        ``obs`` ``(n_envs, *obs)`` the observations returned (reset frames for the envs that ended), ``reward``,
        ``terminated``, ``truncated`` ``(n_envs,)``, and with ``final_obs=True`` ``final_obs`` ``(n_envs, *obs)``,
        read only at the envs that ended. ``infos``/``extra``: ``{name: (n_envs, ...)}``. Anything malformed raises
        naming the argument before anything is written."""
        if not self._started:
            raise RuntimeError("step: reset(obs) the source first")
        if self._device_steps is not None:
            if final_obs is not None or infos is not None or extra is not None:
                raise ValueError("final_obs, infos, extra: a capturable TensorSource takes none of them")
            return self._device_steps.step(actions, obs, reward, terminated, truncated)
        n = self.n_envs
        acts = self._actions.host(actions, n)
        flags = {}
        for name, value in (("reward", reward), ("terminated", terminated), ("truncated", truncated)):
            a = host_array(value, name)
            if a.shape != (n,):
                raise ValueError(f"{name}: expected shape ({n},), got {a.shape}")
            if name != "reward" and a.dtype != bool:
                if a.dtype.kind not in "biu" or not np.isin(a, (0, 1)).all():
                    raise ValueError(f"{name}: expected bools (or 0/1), got {a.dtype} values")
                a = a.astype(bool)
            flags[name] = a
        self._check_obs(obs, "obs")
        infos = self._infos(infos)
        extras = None if extra is None and not self._extra.spec else self._extra.check(extra, n)
        ended = flags["terminated"] | flags["truncated"]
        final = None
        if self.final_obs:
            if final_obs is None:
                raise ValueError("final_obs: this source was built with final_obs=True; pass each step's final "
                                 "observations (n_envs, *obs)")
            f = self._check_obs(final_obs, "final_obs")
            if np.count_nonzero(ended):
                final = f[torch.from_numpy(np.flatnonzero(ended)).to(f.device)]
        elif final_obs is not None:
            raise ValueError("final_obs: this source was built with final_obs=False; build it with final_obs=True to "
                             "store final observations")
        if extras:
            self._extra.store(extras)
        if not self.final_obs:
            return self._rows.receive_resets_in_step(obs, flags["reward"], flags["terminated"], flags["truncated"],
                                                     acts, infos)
        return self._rows.receive_ends_in_step(obs, flags["reward"], flags["terminated"], flags["truncated"], acts,
                                               infos, final, {k: v[ended] for k, v in infos.items()})

    def _check_obs(self, value, name: str) -> torch.Tensor:
        """``value`` as a tensor, checked before anything is written: ``(n_envs, *obs)`` observations the observation
        space's dtype holds (cast by the buffers' rule), else ``ValueError``/``TypeError`` naming ``name``."""
        t = as_tensor(value, name)
        want = (self.n_envs, *self._obs_shape)
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
        check_cast(t, self._obs_dtype, name)
        return t

    def _infos(self, infos) -> dict:
        """``{key: (n_envs, *shape)}`` host arrays of the info fields, checked against ``info_keys``."""
        infos = {} if infos is None else infos
        if not isinstance(infos, dict) or infos.keys() != self._info_spec.keys():
            got = sorted(infos) if isinstance(infos, dict) else type(infos).__name__
            raise ValueError(f"infos: expected the keys of info_keys {sorted(self._info_spec)}, got {got}")
        out = {}
        for key, (shape, dtype) in self._info_spec.items():
            a = host_array(infos[key], f"infos[{key!r}]")
            if a.shape != (self.n_envs, *shape):
                raise ValueError(f"infos[{key!r}]: expected shape {(self.n_envs, *shape)}, got {a.shape}")
            out[key] = exact_info(a, dtype, f"infos[{key!r}]")
        return out
