"""Env outputs -> stacked-info device tensors, and an EnvPool driver that feeds the buffers.

:class:`StepStager` turns one batch of env outputs (numpy, torch on any device, or ``__dlpack__``
arrays from a GPU simulator) into the stacked-info layout on the device: the observation
``(R, 1, *obs)``, the executed ``action`` echo ``(R, 1, A)`` float32 with a fill (NaN unless chosen)
on rows whose action the env ignored (reset frames, and with an :class:`EnvPoolSource` the step
after a life loss of ``episodic_life=True``),
``reward`` ``(R, 1)`` float32, ``terminated``/``truncated`` ``(R, 1)`` bool. Host arrays go through
pinned staging; device arrays are used in place (no host round trip, no copy).

:class:`EnvPoolSource` drives an ``envpool`` env in sync mode (``batch_size == num_envs``) or async
mode (``send``/``recv`` with ``env_id`` routing) and can append every received row to a
:class:`HistoryBuffer` (flushing envs on their reset frame) and insert transitions into a
``TransitionBuffer``. Imports are absolute, so this module (``gpubuf.sources.envpool``) never shadows the
``envpool`` package.
"""

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from gpubuf import ops
from gpubuf._core.concurrency import CallGuard, locked
from gpubuf._core.copies import refuse_copies
from gpubuf._core.inputs import (
    as_flags,
    as_index_array,
    as_tensor,
    check_cast,
    check_flags,
    lossless,
    positive_int,
)
from gpubuf._core.staging import Staging
from gpubuf._core.transition import Transition, flatten, leaf_name


@dataclass
class Step:
    """One received batch: ``info`` in the stacked layout (device), and host-side routing.

    ``info`` tensors are valid until the next step: device inputs are passed through without a copy
    and host inputs bound for CUDA sit in the stager's reusable pinned/device staging. The buffers
    copy what they store. ``env_ids`` ``(R,)`` int64 and ``first`` ``(R,)`` bool (reset frames)
    live on the host, where the env already put them.
    """

    info: dict
    env_ids: np.ndarray
    first: np.ndarray


class StepStager:
    """Puts one batch of env outputs on the device in the stacked-info layout, without a host round
    trip.

    Args:
        n_envs: number of envs (the most rows one call may carry).
        obs_key: the info key of the observation.
        device: output device; ``None`` -> ``cuda`` when available, else ``cpu``.
        action_fill: the ``action`` echo of rows whose action the env ignored (``first`` rows, or
            the ``ignored`` rows given to :meth:`stage`); NaN by default; a real number within
            float32's range (NaN and inf too), else ``TypeError``/``ValueError`` naming it.

    Host arrays bound for CUDA go through preallocated pinned staging (one non-blocking copy per
    key); arrays already on the device are used as they are. Shapes are fixed by the first call.
    """

    def __init__(self, n_envs: int, obs_key: str = "observation", *, device=None,
                 action_fill: float = float("nan")):
        self.action_fill = _echo_fill(action_fill)
        if not isinstance(obs_key, str) or obs_key in ("action", "reward", "terminated",
                                                       "truncated"):
            raise ValueError(f"obs_key: expected a str other than the step keys, got {obs_key!r}")
        self.n_envs = positive_int("n_envs", n_envs)
        self.obs_key = obs_key
        self.device = ops.resolve_device(device)
        self._staging = Staging(self.device)
        self._all_ids = np.arange(self.n_envs, dtype=np.int64)
        self._shapes: dict[str, tuple] = {}  # key -> (1, *per_env), fixed by the first call
        self._dtypes = {"action": torch.float32, "reward": torch.float32, "terminated": torch.bool,
                        "truncated": torch.bool}
        # the last accepted call's layout, per key: (key, numpy dtype, shape, (R, 1, *per_env)
        # view); and (key, value check or None, dtype to cast to or None) of the keys that need
        # more than a view (all of them off the CPU); see _fast
        self._plan = None
        self._plan_post = ()

    def __call__(self, obs, action, reward, terminated, truncated, env_ids=None, first=None,
                 more=None) -> Step:
        """Stage ``R`` rows: ``obs (R, *obs)``, ``action (R,)`` or ``(R, A)``,
        ``reward``/``terminated``/ ``truncated`` ``(R,)``; ``env_ids (R,)`` host ints (all envs if
        ``None``); ``first (R,)`` host bools marking reset frames, whose action echo becomes
        ``action_fill`` (NaN by default);
        ``more``: further keys ``{name: (R, ...)}`` staged as ``(R, 1, ...)`` in their own dtype
        (EnvPool info fields). ``action`` and ``reward`` are stored as float32 and must fit it
        (:func:`gpubuf._core.inputs.check_cast`); ``terminated``/``truncated``/ ``first`` are bool or 0/1
        integers. Every check runs before any write."""
        ids = self._all_ids if env_ids is None else as_index_array(env_ids, "env_ids", self.n_envs)
        R = len(ids)
        first = np.zeros(R, dtype=bool) if first is None else as_flags(first, "first", (R,))
        return self.stage(obs, action, reward, terminated, truncated, ids, first, more)

    def stage(self, obs, action, reward, terminated, truncated, ids: np.ndarray,
              first: np.ndarray, more, ignored: np.ndarray | None = None) -> Step:
        """:meth:`__call__` for a caller whose ``ids`` (host int64 ids in ``[0, n_envs)``) and
        ``first`` (host bool ``(R,)``) are already checked; the values are checked as there.
        ``ignored`` (host bool ``(R,)``, ``first`` when ``None``): the rows whose action echo
        becomes ``action_fill``. An unchanged layout (numpy arrays of the last call's dtypes and
        shapes) takes a cached path."""
        R = len(ids)
        raw = {self.obs_key: obs, "action": action, "reward": reward, "terminated": terminated,
               "truncated": truncated}
        if more:
            for key, value in more.items():
                if key in raw:
                    raise ValueError(f"more: key {key!r} collides with a step key")
                raw[key] = value
        info = self._fast(raw)
        if info is None:
            info = self._checked(raw, R)
        ignored = first if ignored is None else ignored
        if np.count_nonzero(ignored):  # (``.any()`` costs 4x more on a handful of flags)
            mask = self._staging.to_device(torch.from_numpy(ignored), "__first__")
            info["action"] = torch.where(mask.view(R, 1, 1), self.action_fill, info["action"])
        return Step(info, ids, first)

    def _fast(self, raw: dict) -> dict | None:
        """The steady state: every value a C-contiguous numpy array of the dtype and shape of the
        last accepted call (the keys in the same order). ``None`` when anything differs (the
        checked path then decides). Value checks that depend on the data (flags given as integers,
        narrowing casts) still run."""
        plan = self._plan
        if plan is None or len(raw) != len(plan):
            return None
        info = {}
        for (key, value), (want_key, dtype, shape, view) in zip(raw.items(), plan, strict=True):
            if (key != want_key or value.__class__ is not np.ndarray or value.dtype != dtype
                    or value.shape != shape or not value.flags.c_contiguous):
                return None
            info[key] = torch.from_numpy(value.reshape(view))  # numpy's view: cheaper than torch's
        for key, check, cast in self._plan_post:  # keys that need a value check, a copy or a cast
            t = info[key]
            if check is not None:
                check(t, key)
            t = self._staging.to_device(t, key)
            info[key] = t if cast is None else t.to(cast)
        return info

    def _checked(self, raw: dict, R: int) -> dict:
        """Every check, then the staged info; remembers the call's layout for :meth:`_fast`."""
        values = {}
        checks = {}
        for key, value in raw.items():
            t = as_tensor(value, key)
            if t.dim() == 0 or t.shape[0] != R:
                raise ValueError(f"{key}: expected a leading env dim of {R} rows, got shape "
                                 f"{tuple(t.shape)}")
            if key == "action" and t.dim() == 1:
                t = t[:, None]
            elif key in ("reward", "terminated", "truncated") and t.dim() != 1:
                raise ValueError(f"{key}: expected shape ({R},), got {tuple(t.shape)}")
            checks[key] = None
            if key in ("terminated", "truncated"):
                check_flags(t, key)
                if t.dtype != torch.bool:
                    checks[key] = check_flags
            elif key in self._dtypes:
                check_cast(t, self._dtypes[key], key)
                if not lossless(t.dtype, self._dtypes[key]):
                    checks[key] = functools.partial(_check_cast_as, self._dtypes[key])
            values[key] = t.reshape(R, 1, *t.shape[1:])
        if not self._shapes:
            self._shapes = {k: tuple(t.shape[1:]) for k, t in values.items()}
        if values.keys() != self._shapes.keys():
            raise ValueError(f"more: keys are fixed by the first call {sorted(self._shapes)}, got "
                             f"{sorted(values)}")
        for key, t in values.items():
            want = self._shapes[key]
            if tuple(t.shape[1:]) != want:
                raise ValueError(f"{key}: expected per-env shape {want[1:]}, got "
                                 f"{tuple(t.shape[2:])}")
        info = {}
        for key, t in values.items():
            # ``t`` itself when already on the device: no copy
            dev = self._staging.to_device(t, key)
            want = self._dtypes.get(key, dev.dtype)
            info[key] = dev if dev.dtype == want else dev.to(want)
        plain = all(type(v) is np.ndarray and v.dtype.isnative and v.flags.c_contiguous
                    for v in raw.values())
        self._plan = None if not plain else tuple(
            (key, value.dtype, value.shape, values[key].shape) for key, value in raw.items())
        casts = {key: None if info[key].dtype == t.dtype else info[key].dtype
                 for key, t in values.items()}
        self._plan_post = tuple((key, checks[key], casts[key]) for key in raw if
                                checks[key] is not None or casts[key] is not None
                                or self.device.type != "cpu")
        return info


def _check_cast_as(dtype: torch.dtype, t: torch.Tensor, name: str) -> None:
    check_cast(t, dtype, name)


def _space_layout(space) -> tuple[np.dtype, tuple]:
    """The numpy dtype and per-env shape of one action in ``space`` (Discrete -> ``()``)."""
    shape = tuple(getattr(space, "shape", None) or ())
    return np.dtype(space.dtype), shape


def action_fill(dtype) -> float | int | bool:
    """The action stored on a row whose action the env ignored: NaN for float actions, -1 for signed
    integer actions (outside every ``Discrete`` space), the largest value for unsigned ones (False
    for bool)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "fc":
        return float("nan")
    if dtype.kind == "b":
        return False
    return -1 if dtype.kind == "i" else int(np.iinfo(dtype).max)


def _real_number(value, name: str) -> float:
    """``value`` as a Python float when it is a real number (not a bool), else ``TypeError``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                     np.floating)):
        raise TypeError(f"{name}: expected a real number, got {value!r}")
    return float(value)


def _echo_fill(value) -> float:
    """The float32 action echo's fill, checked: a real number float32 holds (NaN and inf too)."""
    v = _real_number(value, "action_fill")
    if np.isfinite(v) and abs(v) > float(np.finfo(np.float32).max):
        raise ValueError(f"action_fill: {value!r} does not fit the float32 action echo")
    return v


def check_action_fill(value, dtype) -> tuple:
    """``(stored fill, echo fill)`` of an ``action_fill`` argument for actions of numpy ``dtype``.

    ``None``: :func:`action_fill` stored and NaN echoed (the defaults). A value is stored as the
    action of every row whose action the env ignored and echoed (as float32) in the history; it
    must fit ``dtype`` exactly (an integer within the range of an integer dtype, 0/1 for bool, a
    real number a float dtype holds without rounding, NaN and inf included) and the float32 echo
    (integers up to ``2**24`` in magnitude), else ``ValueError`` naming ``action_fill``; a value
    that is not a real number is a ``TypeError``."""
    dtype = np.dtype(dtype)
    if value is None:
        return action_fill(dtype), float("nan")
    if dtype.kind == "b" and isinstance(value, (bool, np.bool_)):
        return bool(value), float(value)
    v = _real_number(value, "action_fill")
    why = None
    if dtype.kind == "f":
        if np.isfinite(v) and abs(v) > float(np.finfo(dtype).max):
            why = f"a {dtype} action cannot hold it"
        elif np.isfinite(v) and float(dtype.type(v)) != v:
            why = f"a {dtype} action holds it only rounded (to {float(dtype.type(v))!r})"
    elif not np.isfinite(v) or v != int(v):
        why = f"{dtype} actions are integers"
    else:
        lo, hi = (0, 1) if dtype.kind == "b" else (int(np.iinfo(dtype).min),
                                                   int(np.iinfo(dtype).max))
        if not lo <= int(value) <= hi:
            why = f"{dtype} actions lie in [{lo}, {hi}]"
        elif abs(int(value)) > 2**24:
            why = "the float32 action echo holds integers up to 2**24 exactly"
    if why is None and dtype.kind == "f":
        try:
            echo = _echo_fill(v)
        except ValueError:
            why = "the float32 action echo cannot hold it"
    if why is not None:
        raise ValueError(f"action_fill: {value!r} does not fit the actions ({why})")
    if dtype.kind == "f":
        return float(np.asarray(v, dtype)), echo
    return (bool(v) if dtype.kind == "b" else int(value)), float(int(value))


_RESERVED = ("action", "reward", "terminated", "truncated", "env_id", "players", "is_last")


@refuse_copies("it drives a live EnvPool env; make a new source in the other process and copy "
               "its buffers (state_dict) there")
class EnvPoolSource:
    """Steps an ``envpool`` env and hands every received row to the buffers as device tensors.

    Args:
        env: an ``envpool.make(..., env_type="gymnasium")`` env; async when
            ``batch_size < num_envs``.
        obs_key: info key of the observation (``"pixels"`` suits image envs).
        device: output device; ``None`` -> ``cuda`` when available, else ``cpu``.
        history: a :class:`~gpubuf.HistoryBuffer` with ``n_envs == num_envs``: each received row is
            appended to its env's history, after flushing envs whose row is a reset frame.
        transitions: a ``TransitionBuffer`` built from :meth:`transition_sample` (rows below);
            checked against the source's rows here, or when set later as the :attr:`transitions`
            attribute (also mid-run).
        info_keys: EnvPool info fields to store (e.g. ``("elapsed_step", "lives")``): appended to
            the history under their own names ``(R, 1, ...)`` and stored in the transitions as
            ``info[name]``, the value the env reported with the row's ``observation``. Shapes and
            dtypes are EnvPool's.
        action_fill: the action stored on every row whose action the env ignored (rows below) and
            echoed in the history's ``action`` there. ``None`` (default): :func:`action_fill`
            (NaN for float actions, -1 for signed integer ones) in the transitions and NaN in the
            history's float32 echo. A value must fit the action dtype and the float32 echo (e.g.
            ``0`` keeps ``F.one_hot`` valid on those rows), else ``ValueError`` naming
            ``action_fill`` before anything is built (:func:`check_action_fill`).

    Rows of a vectorized ``transitions`` buffer (sync only; one time row of every env per step). The
    row written at a step holds ``observation`` (what the env showed before the step), ``action``
    (what it executed), ``reward``, ``terminated`` (the env's), ``truncated`` and
    ``info["is_last"]``; its next observation is the next row's ``observation``. After an episode's
    last transition (terminated or truncated), EnvPool's next step ignores its action and returns
    the reset frame (``elapsed_step == 0``): that step's row holds the episode's last observation,
    ``action`` the fill (``action_fill``; by default NaN for float actions, -1 for integer ones),
    reward 0, ``terminated`` False, and ``truncated`` and ``is_last`` True. So the terminal
    observation is the next observation of the episode's last transition, an ``is_last`` row never
    starts a sampled window (``with_next_obs`` never draws one as a transition), the row after it
    holds the reset frame, and the buffers' ``boundaries="mask"`` marks ``is_first`` exactly there.
    An ``is_last`` row holds no transition: batches sampled with ``boundaries="mask"``/``"forbid"``
    carry ``has_transition`` False exactly there (its observation stays inside ``mask``, as a
    world model's target), which a learner of transitions must drop.

    EnvPool's life-loss soft reset (Atari ``episodic_life=True``) is treated like an episode end for
    the ignored action: on a life loss EnvPool reports ``terminated`` (``info["terminated"]`` stays
    False until the game is over) with the observation of the lost life, and its next step ignores
    the action and returns the frame the game resumes from, with the same ``elapsed_step`` and
    reward 0. That step's row is written as after an episode end (the life's last observation,
    the fill, ``is_last`` and ``truncated`` set), so each life is an episode of the buffer; its
    history row echoes the fill (the history is not flushed: the game goes on). The source tells the
    step after any ``terminated`` or ``truncated`` row of an env from its reset frame by
    ``elapsed_step``: a row that is not a reset frame is the soft reset. ``truncated`` is
    set on ``is_last`` rows only: a truncated episode's last transition keeps ``truncated`` False,
    as its next observation (the last one) is real and may be bootstrapped from. A ``reset()`` after
    rows were written ends every episode the same way (one ``is_last`` row per env).

    Rows of a buffer with ``vectorized_env=False`` (sync or async): each received row but reset
    frames is one transition with its ``next_observation`` and the env's
    ``terminated``/``truncated``.

    Extra per-step data: build the buffer from ``transition_sample(extra={name: example})`` and pass
    ``extra={name: (R, ...)}`` with every ``send``/``step``; each value is stored as ``info[name]``
    in the row of the step it was sent with (as sent, on ``is_last`` rows too; :func:`action_fill`
    on the rows a ``reset()`` adds).

    Rows whose action the env ignored (reset frames, and the soft reset after a life loss) echo the
    fill in ``step.info["action"]`` and in the history; with ``vectorized=False`` they are no
    transitions and are skipped.

    Sync: ``step = src.reset(); step = src.step(actions)``. Async: ``step = src.reset()`` (first
    batch), then ``src.send(actions, step.env_ids); step = src.recv()``.

    Threads: one call at a time runs (a lock of the source's own; the buffers keep theirs), so an
    actor thread may step the source while learner threads sample its buffers. Copies and pickles
    are refused (the env cannot be copied).
    """

    def __init__(self, env, *, obs_key: str = "observation", device=None, history=None,
                 transitions=None,
                 info_keys=(), action_fill=None):
        config = getattr(env, "config", None)
        if not isinstance(config, dict) or "num_envs" not in config or not hasattr(env, "recv"):
            raise TypeError("env: expected an envpool env (envpool.make(...)), got "
                            f"{type(env).__name__}")
        self.env = env
        self.n_envs = int(config["num_envs"])
        self.batch_size = int(config["batch_size"])
        self.is_async = self.batch_size < self.n_envs
        self.info_keys = self._check_info_keys(info_keys, obs_key)
        self.action_dtype, self.action_shape = _space_layout(env.action_space)
        # the stored action of rows whose action the env ignored, and its float32 echo
        self.action_fill, echo = check_action_fill(action_fill, self.action_dtype)
        self.stager = StepStager(self.n_envs, obs_key, device=device, action_fill=echo)
        self.device = self.stager.device
        self._guard = CallGuard(self.device)  # one call at a time (threads)
        self._staging = Staging(self.device)
        # Discrete spaces: actions lie in [0, n)
        self.n_actions = getattr(env.action_space, "n", None)
        self._bounds = None  # continuous spaces: (low, high) per action dim, what EnvPool clips to
        if self.action_dtype.kind == "f" and hasattr(env.action_space, "low"):
            self._bounds = (np.broadcast_to(env.action_space.low,
                                            self.action_shape).astype(self.action_dtype),
                            np.broadcast_to(env.action_space.high,
                                            self.action_shape).astype(self.action_dtype))
        self._action_torch_dtype = torch.from_numpy(np.zeros(0, self.action_dtype)).dtype
        # the last accepted actions' (type, dtype, shape, lossless) (see _fast_actions)
        self._action_sig = None
        self._action_buf = np.zeros((self.n_envs, *self.action_shape), dtype=self.action_dtype)
        self._order = np.arange(self.n_envs, dtype=np.int64)  # env ids in order (never returned)
        self._order_bytes = self._order.tobytes()  # a received batch of every env, in order
        # last sent, per env
        self._sent = np.zeros((self.n_envs, *self.action_shape), dtype=self.action_dtype)
        self._in_flight = np.zeros(self.n_envs, dtype=bool)  # sent (or reset), not yet received
        # (n_envs, *obs) device copy of each env's last observation (the pending row)
        self._prev_obs = None
        # host: whether _prev_obs holds one since the reset
        self._has_prev = np.zeros(self.n_envs, dtype=bool)
        self._prev_info = {k: np.zeros((self.n_envs, *s), d) for k, (s,
                                                                     d) in self._info_spec.items()}
        # the buffer holds no row of the env's current episode
        self._fresh = np.ones(self.n_envs, dtype=bool)
        # the env's last received row was terminated or truncated: EnvPool ignores its next action
        self._ended = np.zeros(self.n_envs, dtype=bool)
        # name -> (n_envs, *shape) device tensor: the extra data last sent, per env
        self._extra = {}
        self._history = self._transitions = None
        self._extra_spec_of = {}  # _extra_spec() of the attached transitions buffer
        self.history = history
        self.transitions = transitions

    def _check_info_keys(self, info_keys, obs_key) -> tuple:
        if isinstance(info_keys, (str, bytes)) or not isinstance(info_keys, (tuple, list)):
            raise TypeError("info_keys: expected a tuple of EnvPool info field names such as "
                            f"('elapsed_step',), got {info_keys!r}")
        specs = getattr(getattr(self.env, "spec", None), "state_array_spec", {}) or {}
        self._info_spec = {}
        for key in info_keys:
            if not isinstance(key, str) or key in _RESERVED or key == obs_key:
                raise ValueError("info_keys: expected field names other than "
                                 f"{_RESERVED + (obs_key,)}, got {key!r}")
            spec = specs.get(key if key == "elapsed_step" else f"info:{key}")
            if spec is None or key in self._info_spec:
                have = sorted(k[5:] for k in specs if k.startswith("info:") and k not in (
                    "info:env_id", "info:players.env_id")) + ["elapsed_step"]
                why = ("is listed twice" if key in self._info_spec
                       else f"is not one of this env's fields {have}")
                raise ValueError(f"info_keys: {key!r} {why}")
            self._info_spec[key] = (tuple(int(d) for d in spec.shape if d != -1),
                                    np.dtype(spec.dtype))
        return tuple(info_keys)

    # ------------------------------------------------------------------ buffers

    @property
    def history(self):
        """The attached :class:`~gpubuf.HistoryBuffer` (or ``None``); may be set at any time
        (``n_envs`` must match). One attached later starts with the next received row."""
        return self._history

    @history.setter
    @locked
    def history(self, history) -> None:
        if history is not None and getattr(history, "n_envs", None) != self.n_envs:
            raise ValueError(f"history: expected a HistoryBuffer with n_envs={self.n_envs}, "
                             f"got {getattr(history, 'n_envs', type(history).__name__)}")
        self._history = history

    @property
    def transitions(self):
        """The attached ``TransitionBuffer`` (or ``None``); may be set at any time, also after
        ``reset()`` or mid-run. Its leaves must be those of :meth:`transition_sample` (same paths,
        shapes and dtypes; any further ``info`` leaves are extra data), else a ``ValueError`` naming
        the leaf, before anything is attached. A buffer attached later stores the rows from each
        env's pending observation on (the one already returned by ``reset()``/the last step), so its
        first row is that observation; extra leaves of actions sent before attaching hold
        :func:`action_fill`. Replacing or detaching (``None``) a vectorized buffer ends its episodes
        as a ``reset()`` does (one ``is_last`` row per env holding its pending observation), so
        re-attaching it later never joins two stretches of a run."""
        return self._transitions

    @transitions.setter
    @locked
    def transitions(self, tb) -> None:
        if tb is self._transitions:
            return
        if tb is not None:
            self._check_transitions(tb)
        self._end_episodes()
        self._transitions = tb
        self._extra_spec_of = self._buffer_extra_spec()
        self._fresh[:] = True  # the new buffer holds no row of the current episodes
        self._extra = {name: torch.full((self.n_envs, *s), action_fill(_np_dtype(d)), dtype=d,
                                        device=self.device)
                       for name, (s, d) in self._extra_spec().items()}

    def _check_transitions(self, tb) -> None:
        """``ValueError`` naming the first leaf of ``tb`` that differs from this source's rows."""
        leaves = _buffer_leaves(tb)
        vectorized = bool(tb.vectorized_env)
        if vectorized and self.is_async:
            raise ValueError("transitions: an async env needs a buffer with vectorized_env=False "
                             "(built from transition_sample(vectorized=False))")
        if vectorized and tb.n_envs != self.n_envs:
            raise ValueError(f"transitions: expected a TransitionBuffer over {self.n_envs} envs "
                             f"(build it from transition_sample()), got {tb.n_envs}")
        lead = 2 if vectorized else 1
        want = {p: (tuple(t.shape[lead:]), t.dtype)
                for p, t in flatten(self.transition_sample(vectorized)).items()}
        arg = "" if vectorized else "vectorized=False"
        how = f"build it from this source's transition_sample({arg})"
        for path, (shape, dtype) in want.items():
            if path not in leaves:
                raise ValueError(f"transitions: the buffer has no leaf {leaf_name(path)}, which "
                                 f"this source's rows hold ({how})")
            if leaves[path] != (shape, dtype):
                raise ValueError(f"transitions: leaf {leaf_name(path)} is {leaves[path][1]} "
                                 f"{leaves[path][0]} per row, this source's rows hold {dtype} "
                                 f"{shape} ({how})")
        for path in leaves:
            if path not in want and (path[0] != "info" or len(path) != 2 or path[1] in _RESERVED):
                raise ValueError(f"transitions: the buffer has a leaf {leaf_name(path)}, which "
                                 "this source's rows do not hold (extra data are info leaves; "
                                 f"{how})")

    def _end_episodes(self) -> None:
        """Write each env's pending observation as an ``is_last`` row of a vectorized buffer holding
        rows of the current episodes (a ``reset()``, or the buffer replaced)."""
        if self._has_prev.all() and not self._fresh.all() and self._transitions is not None \
                and self._transitions.vectorized_env:
            self._insert_last_rows()

    # ------------------------------------------------------------------ stepping

    @locked
    def reset(self) -> Step:
        """Reset every env (sync) or start the async pool; returns the first received batch. With a
        vectorized ``transitions`` buffer that holds rows, each env's last observation is first
        written as an ``is_last`` row (the episode ends there); an env whose last observation was
        already a reset frame then holds a one-row episode of that frame."""
        self._end_episodes()
        self._sent[:] = 0
        self._has_prev[:] = False
        self._ended[:] = False
        if self.is_async:
            self.env.async_reset()
            self._in_flight[:] = True
            return self.recv()
        obs, info = self.env.reset()
        n = len(info["env_id"])
        zeros = np.zeros(n, dtype=np.float32)
        return self._receive(obs, zeros, zeros.astype(bool), zeros.astype(bool), info)

    @locked
    def send(self, actions, env_ids=None, extra=None) -> None:
        """Send one action per listed env (all envs if ``None``): ``(R,)`` for discrete, ``(R,
        *shape)``.

        ``env_ids`` must be distinct envs that are not in flight (sent or reset and not yet
        received); with a vectorized ``transitions`` buffer every env steps together, so ``env_ids``
        must cover all envs. A discrete env takes integers in ``[0, n)``; floats are accepted only
        when integral (``2.0``), so a continuous planner's output must be mapped explicitly (e.g.
        ``(plan > 0).long()``). A continuous env takes finite values that fit its action dtype;
        values outside its ``Box`` are clipped to it before they are sent, as EnvPool would apply
        them, so the buffers store what the env executed (clipping, not rejecting: a Gaussian
        policy's samples routinely leave the box, and the env accepts them). ``actions`` is ``(R,
        *shape)`` (singleton axes may be added or dropped). ``extra``: ``{name: (R, ...)}`` per-env
        data for the transitions buffer's own ``info`` leaves (see the class). Anything else is a
        ``ValueError``/``TypeError`` before anything is sent."""
        if env_ids is None:  # every env, in order: distinct by construction
            if np.count_nonzero(self._in_flight):
                self._raise_in_flight(self._order)
            acts = self._host_actions(actions, self.n_envs)
            extras = ({} if extra is None and not self._extra_spec_of
                      else self._check_extra(extra, self.n_envs))
            self.env.send(acts)  # EnvPool's own all-envs path
            self._sent[...] = acts
            self._in_flight[...] = True
            for name, t in extras.items():
                self._extra[name].copy_(t)
            return
        ids = as_index_array(env_ids, "env_ids", self.n_envs)
        if len(np.unique(ids)) != len(ids):
            dup = np.unique(ids[np.bincount(ids, minlength=self.n_envs)[ids] > 1])
            raise ValueError("env_ids: each env takes one action per send, got duplicates "
                             f"{dup[:5].tolist()}")
        if self._in_flight[ids].any():
            self._raise_in_flight(ids)
        tb = self.transitions
        if tb is not None and tb.vectorized_env and len(ids) != self.n_envs:
            raise ValueError("env_ids: a vectorized transitions buffer stores one time row of all "
                             f"{self.n_envs} envs per step; send an action to every env, got "
                             f"{len(ids)}")
        acts = self._host_actions(actions, len(ids))
        extras = self._check_extra(extra, len(ids))
        self.env.send(acts, ids.astype(np.int32))
        self._sent[ids] = acts
        self._in_flight[ids] = True
        if extras:
            dev_ids = self._staging.to_device(torch.from_numpy(ids.astype(np.int64)),
                                              "__extra_ids__")
            for name, t in extras.items():
                self._extra[name].index_copy_(0, dev_ids, t)

    def _raise_in_flight(self, ids: np.ndarray) -> None:
        raise ValueError(f"env_ids: envs {ids[self._in_flight[ids]][:5].tolist()} are in "
                         "flight (sent or reset, not yet received): recv() them before sending "
                         "again")

    @locked
    def recv(self) -> Step:
        """Receive the next batch (``batch_size`` rows), stage it and feed the attached buffers.
        Fewer than ``batch_size`` envs in flight (sent or reset, not yet received) raise
        ``RuntimeError`` instead of waiting forever (the pool returns only full batches)."""
        waiting = int(np.count_nonzero(self._in_flight))
        if waiting < self.batch_size:
            raise RuntimeError(f"recv: {waiting} envs are in flight, fewer than the batch_size "
                               f"{self.batch_size} the pool returns; send() actions first")
        obs, reward, terminated, truncated, info = self.env.recv()
        return self._receive(obs, reward, terminated, truncated, info)

    @locked
    def step(self, actions, env_ids=None, extra=None) -> Step:
        """``send`` then ``recv`` (in async mode the received envs may differ from the sent
        ones)."""
        self.send(actions, env_ids, extra)
        return self.recv()

    def _host_actions(self, actions, R: int) -> np.ndarray:
        """``actions`` as the ``(R, *shape)`` host array to send (clipped for a ``Box``), checked.
        The returned array may be reused by the next call."""
        sig = self._action_sig
        if (sig is not None and type(actions) is sig[0] and actions.dtype == sig[1]
                and actions.shape == sig[2] and sig[2][0] == R):
            arr = self._fast_actions(actions, R, sig[3])
            if arr is not None:
                return arr
        arr = self._checked_actions(actions, R)
        self._action_sig = self._signature(actions)
        return arr

    def _signature(self, actions):
        """The steady-state signature of accepted ``actions``: numpy arrays, and CPU tensors that
        read as one (``None`` for anything else: the checked path every time)."""
        if type(actions) is torch.Tensor:
            if actions.device.type != "cpu" or actions.dtype not in (
                    torch.float16, torch.float32, torch.float64, torch.int8, torch.int16,
                    torch.int32, torch.int64, torch.uint8):
                return None
            dtype = torch.empty(0, dtype=actions.dtype).numpy().dtype
        elif type(actions) is np.ndarray and actions.dtype.isnative:
            dtype = actions.dtype
        else:
            return None
        if dtype.kind != self.action_dtype.kind and not (self.action_dtype.kind == "u"
                                                         and dtype.kind == "i"):
            return None  # float actions for a discrete env: checked path (integrality)
        ok = lossless(torch.from_numpy(np.zeros(0, dtype)).dtype, self._action_torch_dtype)
        return type(actions), actions.dtype, tuple(actions.shape), ok

    def _fast_actions(self, actions, R: int, is_lossless: bool) -> np.ndarray | None:
        """The steady state: actions of the last accepted type, dtype and shape. ``None`` to take
        the checked path (a bad value: it raises there, with its message)."""
        if type(actions) is torch.Tensor:
            if actions.device.type != "cpu":
                return None
            try:
                arr = actions.detach().numpy()
            except RuntimeError:  # a lazy negation: the checked path resolves it
                return None
        else:
            arr = actions
        want = self._action_buf[:R] if R != self.n_envs else self._action_buf
        if self.action_dtype.kind == "f":
            if np.count_nonzero(np.isfinite(arr)) != arr.size:
                return None
            if not is_lossless:
                try:
                    check_cast(torch.from_numpy(np.ascontiguousarray(arr)),
                               self._action_torch_dtype, "actions")
                except (TypeError, ValueError):
                    return None
            arr = arr.reshape(want.shape)
            if self._bounds is None:
                np.copyto(want, arr)
            else:  # np.clip, as ufuncs (the wrapper costs more than the work)
                np.minimum(arr, self._bounds[1], out=want)
                np.maximum(want, self._bounds[0], out=want)
            return want
        n = self.n_actions
        if n is not None and arr.size and not (0 <= arr.min() and arr.max() < n):
            return None
        if not is_lossless and n is None:
            return None
        np.copyto(want, arr.reshape(want.shape), casting="unsafe")
        return want

    def _checked_actions(self, actions, R: int) -> np.ndarray:
        if isinstance(actions, torch.Tensor):
            actions = actions.detach().cpu()  # envpool steps on the host: one read per step
            if actions.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
                actions = actions.float()  # dtypes numpy lacks, widened exactly
            actions = as_tensor(actions, "actions").resolve_conj().resolve_neg().numpy()
        arr = np.asarray(actions)
        want = (R, *self.action_shape)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"actions: expected numbers shaped {want}, got a {arr.dtype} array")
        if arr.ndim == 0 or arr.shape[0] != R or [d for d in arr.shape[1:] if d != 1] != [
                d for d in self.action_shape if d != 1]:
            raise ValueError(f"actions: expected shape {want}, got {arr.shape}")
        if self.action_dtype.kind == "f":  # a continuous env: finite values its dtype holds
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise ValueError("actions: expected finite actions, got "
                                 f"{arr[~np.isfinite(arr)][:5].tolist()}")
            check_cast(torch.from_numpy(np.ascontiguousarray(arr)), torch.from_numpy(
                np.zeros(0, self.action_dtype)).dtype, "actions")
            arr = arr.reshape(want).astype(self.action_dtype)
            if self._bounds is not None:  # what the env executes (EnvPool clips to its box)
                arr = np.clip(arr, *self._bounds)
            return arr
        # a discrete env: integral actions only, never truncated silently
        if self.action_dtype.kind in "iu":
            if arr.dtype.kind == "f" and not np.array_equal(arr, np.trunc(arr)):
                bad = arr[~(arr == np.trunc(arr))][:5].tolist()
                raise ValueError(f"actions: a discrete env takes integer actions, got {bad}; map a "
                                 "continuous planner's output explicitly (e.g. (plan > 0).long() "
                                 "or plan.round())")
            n = self.n_actions
            if n is not None and arr.size and not (0 <= arr.min() and arr.max() < n):
                raise ValueError(f"actions: expected actions in [0, {self.n_actions}), got "
                                 f"[{arr.min()}, {arr.max()}]")
        return arr.reshape(want).astype(self.action_dtype, copy=False)

    def _extra_spec(self) -> dict:
        """``{name: (per-env shape, dtype)}`` of the transitions buffer's ``info`` leaves the source
        does not fill itself: the user's extra data (fixed while the buffer is attached)."""
        return self._extra_spec_of

    def _buffer_extra_spec(self) -> dict:
        tb = self._transitions
        if tb is None:
            return {}
        own = set(self.info_keys) | {"is_last"}
        return {p[1]: spec for p, spec in _buffer_leaves(tb).items()
                if p[0] == "info" and len(p) == 2 and p[1] not in own}

    def _check_extra(self, extra, R: int) -> dict:
        """``extra`` checked against the buffer's leaves: ``{name: (R, *shape) device tensor}`` in
        its dtype."""
        spec = self._extra_spec()
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise TypeError(f"extra: expected a dict of per-env arrays, got {type(extra).__name__}")
        if extra.keys() != spec.keys():
            where = ("the transitions buffer's own info leaves" if self.transitions is not None
                     else "a transitions buffer built from transition_sample(extra=...)")
            raise ValueError(f"extra: expected the keys of {where} {sorted(spec)}, got "
                             f"{sorted(extra)}")
        out = {}
        for name, value in extra.items():
            shape, dtype = spec[name]
            t = as_tensor(value, f"extra[{name!r}]")
            if tuple(t.shape) != (R, *shape):
                raise ValueError(f"extra[{name!r}]: expected shape {(R, *shape)}, got "
                                 f"{tuple(t.shape)}")
            check_cast(t, dtype, f"extra[{name!r}]")
            out[name] = t
        staged = {}
        for name, t in out.items():
            shape, dtype = spec[name]
            held = self._extra.get(name)
            if held is None or held.shape[1:] != shape or held.dtype != dtype:
                self._extra[name] = torch.full((self.n_envs, *shape), action_fill(_np_dtype(dtype)),
                                               dtype=dtype,
                                               device=self.device)
            staged[name] = t.to(self.device, dtype)
        return staged

    def _receive(self, obs, reward, terminated, truncated, info) -> Step:
        ids = np.asarray(info["env_id"], dtype=np.int64)
        n = self.n_envs
        # every env, in env order (sync mode): whole-array updates instead of scatters
        in_order = ids.tobytes() == self._order_bytes
        if in_order:
            self._in_flight[...] = False
            sent = self._sent
        else:
            ids = as_index_array(ids, "env_ids", n)
            self._in_flight[ids] = False
            sent = self._sent[ids]
        first = np.asarray(info["elapsed_step"]) == 0
        # the rows whose action the env ignored: reset frames, and the soft reset that follows an
        # end without one (a life loss with episodic_life=True)
        was_ended = self._ended if in_order else self._ended[ids]
        ignored = first | was_ended if np.count_nonzero(was_ended) else first
        infos = {}
        for key, (shape, dtype) in self._info_spec.items():
            a = np.asarray(info[key])
            if a.shape != (len(ids), *shape) or a.dtype != dtype:
                raise ValueError(f"info_keys: EnvPool's {key!r} came as {a.dtype} {a.shape}, "
                                 f"expected {dtype} {(len(ids), *shape)}")
            infos[key] = a
        # the action echo: a fresh float32 copy (``sent`` may be the source's own array)
        echo = sent.reshape(len(ids), -1).astype(np.float32)
        step = self.stager.stage(obs, echo, reward, terminated, truncated, ids, first, infos,
                                 ignored)
        if self._history is not None:
            if np.count_nonzero(first):
                self._history.reset(ids[first])
            self._history.append(step.info, env_ids=ids)
        if self._transitions is not None:
            self._insert_transition(step, ignored, sent, reward, terminated, truncated)
        self._remember(step, in_order)
        for key, a in infos.items():
            if in_order:
                self._prev_info[key][...] = a
            else:
                self._prev_info[key][ids] = a
        ended = np.asarray(terminated, dtype=bool) | np.asarray(truncated, dtype=bool)
        if in_order:
            self._fresh[...] = ignored
            self._ended[...] = ended
        else:
            self._fresh[ids] = ignored
            self._ended[ids] = ended
        return step

    def _remember(self, step: Step, in_order: bool) -> None:
        """Keep each received env's observation: the pending row, stored by the next step (or a
        buffer attached before it)."""
        rows, ids = step.info[self.stager.obs_key], step.env_ids  # (R, 1, *obs)
        if self._prev_obs is None:
            self._prev_obs = torch.zeros((self.n_envs, *rows.shape[2:]), dtype=rows.dtype,
                                         device=self.device)
            self._prev_rows = self._prev_obs[:, None]
        if in_order:
            # sync, in env order: a plain copy (index_copy_ is ~40x slower on CPU)
            self._prev_rows.copy_(rows)
            self._has_prev[...] = True
            return
        obs = rows[:, 0]
        self._prev_obs.index_copy_(0,
                                   self._staging.to_device(torch.from_numpy(ids),
                                                           "__prev_ids__"), obs)
        self._has_prev[ids] = True

    # ------------------------------------------------------------------ transitions

    @locked
    def transition_sample(self, vectorized: bool = True, extra=None):
        """A ``Transition`` shaped like one insert, to build the ``transitions`` buffer from.

        ``vectorized=True`` (sync only): leaves ``(1, num_envs, ...)``, one time row per step, next
        observations inferred by the buffer, ``info["is_last"]`` marking the rows that hold no
        transition (see the class). ``vectorized=False`` (sync or async; build the buffer with
        ``vectorized_env=False``): leaves ``(1, ...)`` with an explicit ``next_observation``; each
        received row is one transition and reset frames are skipped. Either way ``info`` holds the
        ``info_keys`` fields and ``extra``: ``{name: example}``, one env's value of each extra leaf
        (its shape and dtype; e.g. ``np.float32(0)`` for a log-probability), which every
        ``send``/``step`` must then pass.
        """
        space = self.env.observation_space
        lead = (1, self.n_envs) if vectorized else (1,)
        obs = torch.from_numpy(np.zeros((*lead, *space.shape), dtype=space.dtype))
        info = {"is_last": torch.zeros(lead, dtype=torch.bool)} if vectorized else {}
        info.update({k: torch.from_numpy(np.zeros((*lead, *s), d))
                     for k, (s, d) in self._info_spec.items()})
        if extra is not None:
            if not isinstance(extra, Mapping):
                raise TypeError("extra: expected a dict of example values, got "
                                f"{type(extra).__name__}")
            for name, value in extra.items():
                if not isinstance(name, str) or name in info or name in _RESERVED:
                    raise ValueError("extra: expected names other than "
                                     f"{sorted(set(info) | set(_RESERVED))}, got {name!r}")
                t = as_tensor(np.asarray(value) if not isinstance(value, torch.Tensor) else value,
                              f"extra[{name!r}]")
                info[name] = torch.zeros((*lead, *t.shape), dtype=t.dtype)
        return Transition(
            observation=obs,
            action=torch.from_numpy(np.zeros((*lead, *self.action_shape), dtype=self.action_dtype)),
            reward=torch.zeros(lead, dtype=torch.float32),
            terminated=torch.zeros(lead, dtype=torch.bool),
            truncated=torch.zeros(lead, dtype=torch.bool),
            next_observation=None if vectorized else obs.clone(),
            info=info,
        )

    def _extra_rows(self, env_ids: np.ndarray) -> dict:
        """The extra data last sent to ``env_ids`` (host ints), ``{name: (len, *shape)}`` device
        tensors."""
        spec = self._extra_spec()
        if not spec:
            return {}
        dev = self._staging.to_device(torch.from_numpy(env_ids.astype(np.int64)), "__extra_rows__")
        return {name: self._extra[name].index_select(0, dev) for name in spec}

    def _insert_last_rows(self) -> None:
        """One ``is_last`` row per env: each env's last observation ends its episode (a
        ``reset()``)."""
        n = self.n_envs
        fill = np.full((n, *self.action_shape), self.action_fill, dtype=self.action_dtype)
        extra = {name: torch.full((n, *s), action_fill(_np_dtype(d)), dtype=d, device=self.device)
                 for name, (s, d) in self._extra_spec().items()}
        info = {"is_last": np.ones(n, dtype=bool),
                **{k: v.copy() for k, v in self._prev_info.items()}, **extra}
        self.transitions.insert(Transition(
            observation=self._prev_obs[None], action=fill[None],
                                           reward=np.zeros((1, n), np.float32),
            terminated=np.zeros((1, n), bool), truncated=np.ones((1, n), bool),
                                           next_observation=None,
            info={k: v[None] for k, v in info.items()}))
        self._fresh[:] = True

    def _insert_transition(self, step: Step, ignored: np.ndarray, sent, reward, terminated,
                           truncated) -> None:
        """Write the rows of a received step; ``ignored`` (R,) marks the rows whose action the env
        ignored (reset frames and soft resets), written as ``is_last`` rows (vectorized) or
        skipped."""
        obs = step.info[self.stager.obs_key][:, 0]  # (R, *obs)
        ids = step.env_ids
        if not self._has_prev[ids].any():  # nothing pending (after a reset): no row to write
            return
        dev_ids = self._staging.to_device(torch.from_numpy(ids), "__transition_ids__")
        reward = np.asarray(reward, dtype=np.float32)
        terminated, truncated = np.asarray(terminated, dtype=bool), np.asarray(truncated,
                                                                               dtype=bool)
        if self.transitions.vectorized_env:
            # rows in env order; the row of a step whose action was ignored holds the last
            # observation
            if self._has_prev.all():
                order = np.argsort(ids)
                first = ignored[order]
                action = np.where(first.reshape(-1, *[1] * len(self.action_shape)),
                                  np.asarray(self.action_fill, self.action_dtype), sent[order])
                info = {"is_last": first, **{k: v.copy() for k, v in self._prev_info.items()},
                        **self._extra_rows(ids[order])}
                self.transitions.insert(Transition(
                    observation=self._prev_obs[None], next_observation=None, action=action[None],
                    reward=np.where(first, 0.0, reward[order]).astype(np.float32)[None],
                    terminated=(terminated[order] & ~first)[None], truncated=first[None],
                    info={k: v[None] for k, v in info.items()}))
        else:
            keep = self._has_prev[ids] & ~ignored
            if keep.any():
                rows = np.flatnonzero(keep)
                dev_rows = self._staging.to_device(torch.from_numpy(rows), "__transition_rows__")
                info = {**{k: v[ids[rows]] for k, v in self._prev_info.items()},
                        **self._extra_rows(ids[rows])}
                self.transitions.insert(Transition(
                    observation=self._prev_obs[dev_ids[dev_rows]], next_observation=obs[dev_rows],
                    action=sent[rows], reward=reward[rows], terminated=terminated[rows],
                                                   truncated=truncated[rows],
                    info=info))


def _buffer_leaves(tb) -> dict:
    """``{path: (per-row shape without the env axis, dtype)}`` of a transitions buffer's stored
    leaves."""
    leaves = getattr(getattr(tb, "config", None), "leaves", None)
    if leaves is None or not hasattr(tb, "vectorized_env") or not hasattr(tb, "insert"):
        raise TypeError(f"transitions: expected a TransitionBuffer built from transition_sample(), "
                        f"got {type(tb).__name__}")
    return {tuple(leaf.path): (tuple(leaf.shape), leaf.dtype) for leaf in leaves}


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype of a torch dtype (float for the float types numpy lacks)."""
    try:
        return np.dtype(torch.empty(0, dtype=dtype).numpy().dtype)
    except TypeError:
        return np.dtype(np.float32) if dtype.is_floating_point else np.dtype(np.int64)
