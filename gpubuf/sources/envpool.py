"""An EnvPool driver that feeds the buffers.

:class:`EnvPoolSource` drives an ``envpool`` env in sync mode (``batch_size == num_envs``) or async mode
(``send``/``recv`` with ``env_id`` routing) and can append every received row to a :class:`~gpubuf.HistoryBuffer`
(flushing envs on their reset frame) and insert transitions into a ``TransitionBuffer``, by the row convention of
:mod:`gpubuf.sources.rows`. Imports are absolute, so this module (``gpubuf.sources.envpool``) never shadows the
``envpool`` package. ``Step``, ``StepStager`` (:mod:`gpubuf.sources.staging`), ``action_fill`` and ``check_action_fill``
(:mod:`gpubuf.sources.actions`) are importable from here too."""

import numpy as np

from gpubuf._core.concurrency import locked
from gpubuf._core.copies import refuse_copies
from gpubuf._core.inputs import as_index_array
from gpubuf.sources.actions import action_fill, check_action_fill
from gpubuf.sources.layout import RESERVED
from gpubuf.sources.source import RowSource
from gpubuf.sources.staging import Step, StepStager

__all__ = ["EnvPoolSource", "Step", "StepStager", "action_fill", "check_action_fill", "info_spec"]


def info_spec(env, info_keys, obs_key: str) -> dict:
    """``{key: (per-env shape, numpy dtype)}`` of the EnvPool info fields ``info_keys`` of ``env``, checked."""
    if isinstance(info_keys, (str, bytes)) or not isinstance(info_keys, (tuple, list)):
        raise TypeError("info_keys: expected a tuple of EnvPool info field names such as ('elapsed_step',), got "
                        f"{info_keys!r}")
    specs = getattr(getattr(env, "spec", None), "state_array_spec", {}) or {}
    out = {}
    for key in info_keys:
        if not isinstance(key, str) or key in RESERVED or key == obs_key:
            raise ValueError(f"info_keys: expected field names other than {RESERVED + (obs_key,)}, got {key!r}")
        spec = specs.get(key if key == "elapsed_step" else f"info:{key}")
        if spec is None or key in out:
            have = sorted(k[5:] for k in specs if k.startswith("info:") and k not in (
                "info:env_id", "info:players.env_id")) + ["elapsed_step"]
            why = "is listed twice" if key in out else f"is not one of this env's fields {have}"
            raise ValueError(f"info_keys: {key!r} {why}")
        out[key] = (tuple(int(d) for d in spec.shape if d != -1), np.dtype(spec.dtype))
    return out


@refuse_copies("it drives a live EnvPool env; make a new source in the other process and copy its buffers "
               "(state_dict) there")
class EnvPoolSource(RowSource):
    """Steps an ``envpool`` env and hands every received row to the buffers as device tensors.

    Args:
        env: an ``envpool.make(..., env_type="gymnasium")`` env; async when ``batch_size < num_envs``.
        obs_key: info key of the observation (``"pixels"`` suits image envs).
        device: output device; ``None`` -> ``cuda`` when available, else ``cpu``.
        history: a :class:`~gpubuf.HistoryBuffer` with ``n_envs == num_envs``: each received row is appended to its
            env's history, after flushing envs whose row is a reset frame.
        transitions: a ``TransitionBuffer`` built from :meth:`transition_sample`; checked against the source's rows
            here, or when set later as the :attr:`transitions` attribute (also mid-run).
        info_keys: EnvPool info fields to store (e.g. ``("elapsed_step", "lives")``): appended to the history under
            their own names ``(R, 1, ...)`` and stored in the transitions as ``info[name]``, the value the env reported
            with the row's ``observation``. Shapes and dtypes are EnvPool's.
        action_fill: the action stored on every row whose action the env ignored (reset frames, and the step after a
            life loss of Atari's ``episodic_life=True``) and echoed in the history's ``action`` there. ``None``
            (default): :func:`~gpubuf.sources.actions.action_fill` (NaN for float actions, -1 for signed integer ones)
            in the transitions and NaN in the history's float32 echo. A value must fit the action dtype and the float32
            echo (e.g. ``0`` keeps ``F.one_hot`` valid on those rows), else ``ValueError`` naming ``action_fill`` before
            anything is built (:func:`~gpubuf.sources.actions.check_action_fill`).

    Rows follow :mod:`gpubuf.sources.rows`: a vectorized buffer (sync only) gets one time row of every env per step,
    with ``vectorized_env=False`` (sync or async) one transition per received row but reset frames.

    Extra per-step data: build the buffer from ``transition_sample(extra={name: example})`` and pass
    ``extra={name: (R, ...)}`` with every ``send``/``step``; each value is stored as ``info[name]`` in the row of the
    step it was sent with.

    Sync: ``step = src.reset(); step = src.step(actions)``. Async: ``step = src.reset()`` (first batch), then
    ``src.send(actions, step.env_ids); step = src.recv()``.

    Threads: one call at a time runs (a lock of the source's own; the buffers keep theirs), so an actor thread may step
    the source while learner threads sample its buffers. Copies and pickles are refused (the env cannot be copied)."""

    def __init__(self, env, *, obs_key: str = "observation", device=None, history=None, transitions=None,
                 info_keys=(), action_fill=None):
        config = getattr(env, "config", None)
        if not isinstance(config, dict) or "num_envs" not in config or not hasattr(env, "recv"):
            raise TypeError(f"env: expected an envpool env (envpool.make(...)), got {type(env).__name__}")
        self.env = env
        n_envs = int(config["num_envs"])
        self.batch_size = int(config["batch_size"])
        self.is_async = self.batch_size < n_envs
        self.info_keys = tuple(info_keys)
        super().__init__(n_envs, env.action_space, env.observation_space, obs_key=obs_key, device=device,
                         action_fill=action_fill, info_spec=info_spec(env, info_keys, obs_key),
                         single_rows="an async env" if self.is_async else "")
        self._order = np.arange(self.n_envs, dtype=np.int64)  # env ids in order (never returned)
        self._order_bytes = self._order.tobytes()  # a received batch of every env, in order
        self._sent = self._actions.zeros((self.n_envs,))  # last sent, per env
        self._in_flight = np.zeros(self.n_envs, dtype=bool)  # sent (or reset), not yet received
        self.history = history
        self.transitions = transitions

    # ------------------------------------------------------------------ stepping

    @locked
    def reset(self) -> Step:
        """Reset every env (sync) or start the async pool; returns the first received batch. With a vectorized
        ``transitions`` buffer that holds rows, each env's last observation is first written as an ``is_last`` row (the
        episode ends there); an env whose last observation was already a reset frame then holds a one-row episode of
        that frame."""
        self._rows.restart()
        self._sent[:] = 0
        if self.is_async:
            self.env.async_reset()
            self._in_flight[:] = True
            return self.recv()
        obs, info = self.env.reset()
        zeros = np.zeros(len(info["env_id"]), dtype=np.float32)
        return self._receive(obs, zeros, zeros.astype(bool), zeros.astype(bool), info)

    @locked
    def send(self, actions, env_ids=None, extra=None) -> None:
        """Send one action per listed env (all envs if ``None``): ``(R,)`` for discrete, ``(R, *shape)``.

        ``env_ids`` must be distinct envs that are not in flight (sent or reset and not yet received); with a vectorized
        ``transitions`` buffer every env steps together, so ``env_ids`` must cover all envs. A discrete env takes
        integers (or bools, as 0 and 1) in ``[0, n)``; floats are accepted only when integral (``2.0``), so a continuous
        planner's output must be mapped explicitly (e.g. ``(plan > 0).long()``). A continuous env takes finite values
        that fit its action dtype; values outside its ``Box`` are clipped to it before they are sent, as EnvPool would
        apply them, so the buffers store what the env executed (clipping, not rejecting: a Gaussian policy's samples
        routinely leave the box, and the env accepts them). ``actions`` is ``(R, *shape)`` (singleton axes may be added
        or dropped). ``extra``: ``{name: (R, ...)}`` per-env data for the transitions buffer's own ``info`` leaves (see
        the class). Anything else is a ``ValueError``/``TypeError`` before anything is sent."""
        if env_ids is None:  # every env, in order: distinct by construction
            if np.count_nonzero(self._in_flight):
                self._raise_in_flight(self._order)
            acts = self._actions.host(actions, self.n_envs)
            extras = None if extra is None and not self._extra.spec else self._extra.check(extra, self.n_envs)
            self.env.send(acts)  # EnvPool's own all-envs path
            self._sent[...] = acts
            self._in_flight[...] = True
            if extras:
                self._extra.store(extras)
            return
        ids = as_index_array(env_ids, "env_ids", self.n_envs)
        if len(np.unique(ids)) != len(ids):
            dup = np.unique(ids[np.bincount(ids, minlength=self.n_envs)[ids] > 1])
            raise ValueError(f"env_ids: each env takes one action per send, got duplicates {dup[:5].tolist()}")
        if self._in_flight[ids].any():
            self._raise_in_flight(ids)
        self._rows.check_envs(len(ids))
        acts = self._actions.host(actions, len(ids))
        extras = self._extra.check(extra, len(ids))
        self.env.send(acts, ids.astype(np.int32))
        self._sent[ids] = acts
        self._in_flight[ids] = True
        self._extra.store(extras, ids)

    def _raise_in_flight(self, ids: np.ndarray) -> None:
        raise ValueError(f"env_ids: envs {ids[self._in_flight[ids]][:5].tolist()} are in flight (sent or reset, not "
                         "yet received): recv() them before sending again")

    @locked
    def recv(self) -> Step:
        """Receive the next batch (``batch_size`` rows), stage it and feed the attached buffers. Fewer than
        ``batch_size`` envs in flight (sent or reset, not yet received) raise ``RuntimeError`` instead of waiting
        forever (the pool returns only full batches)."""
        waiting = int(np.count_nonzero(self._in_flight))
        if waiting < self.batch_size:
            raise RuntimeError(f"recv: {waiting} envs are in flight, fewer than the batch_size {self.batch_size} the "
                               "pool returns; send() actions first")
        obs, reward, terminated, truncated, info = self.env.recv()
        return self._receive(obs, reward, terminated, truncated, info)

    @locked
    def step(self, actions, env_ids=None, extra=None) -> Step:
        """``send`` then ``recv`` (in async mode the received envs may differ from the sent ones)."""
        self.send(actions, env_ids, extra)
        return self.recv()

    def _receive(self, obs, reward, terminated, truncated, info) -> Step:
        """Route one batch of EnvPool outputs (``info`` carries ``env_id`` and ``elapsed_step``) to the row writer."""
        ids = np.asarray(info["env_id"], dtype=np.int64)
        in_order = ids.tobytes() == self._order_bytes  # every env, in env order (sync mode)
        if in_order:
            self._in_flight[...] = False
            sent = self._sent
        else:
            ids = as_index_array(ids, "env_ids", self.n_envs)
            self._in_flight[ids] = False
            sent = self._sent[ids]
        infos = {}
        for key, (shape, dtype) in self._info_spec.items():
            a = np.asarray(info[key])
            if a.shape != (len(ids), *shape) or a.dtype != dtype:
                raise ValueError(f"info_keys: EnvPool's {key!r} came as {a.dtype} {a.shape}, expected {dtype} "
                                 f"{(len(ids), *shape)}")
            infos[key] = a
        first = np.asarray(info["elapsed_step"]) == 0
        return self._rows.receive(obs, reward, terminated, truncated, ids, first, sent, infos, in_order)
