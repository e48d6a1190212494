"""The row convention: how a source writes each received row of its envs into a history and a transitions buffer.

:class:`RowWriter` takes one received batch at a time from any source (an EnvPool driver, a vector env, a GPU simulator)
as host-side routing (env ids, reset-frame flags, the executed actions, rewards, ends) plus the env's arrays, stages it
with a :class:`~gpubuf.sources.staging.StepStager` and writes it.

Rows of a vectorized ``transitions`` buffer (sync only; one time row of every env per step). The row written at a step
holds ``observation`` (what the env showed before the step), ``action`` (what it executed), ``reward``, ``terminated``
(the env's), ``truncated`` and ``info["is_last"]``; its next observation is the next row's ``observation``. After an
episode's last transition (terminated or truncated), the env's next step ignores its action and returns the reset frame
(``elapsed_step == 0``): that step's row holds the episode's last observation, ``action`` the fill (``action_fill``; by
default NaN for float actions, -1 for integer ones), reward 0, ``terminated`` False, and ``truncated`` and ``is_last``
True. So the terminal observation is the next observation of the episode's last transition, an ``is_last`` row never
starts a sampled window (``with_next_obs`` never draws one as a transition), the row after it holds the reset frame, and
the buffers' ``boundaries="mask"`` marks ``is_first`` exactly there. An ``is_last`` row holds no transition: batches
sampled with ``boundaries="mask"``/``"forbid"`` carry ``has_transition`` False exactly there (its observation stays
inside ``mask``, as a world model's target), which a learner of transitions must drop.

A life-loss soft reset (EnvPool's Atari ``episodic_life=True``) is treated like an episode end for the ignored action:
on a life loss the env reports ``terminated`` (``info["terminated"]`` stays False until the game is over) with the
observation of the lost life, and its next step ignores the action and returns the frame the game resumes from, with the
same ``elapsed_step`` and reward 0. That step's row is written as after an episode end (the life's last observation, the
fill, ``is_last`` and ``truncated`` set), so each life is an episode of the buffer; its history row echoes the fill (the
history is not flushed: the game goes on). The step after any ``terminated`` or ``truncated`` row of an env is told from
its reset frame by the reset-frame flag: a row that is not a reset frame is the soft reset. ``truncated`` is set on
``is_last`` rows only: a truncated episode's last transition keeps ``truncated`` False, as its next observation (the
last one) is real and may be bootstrapped from. A reset after rows were written ends every episode the same way (one
``is_last`` row per env).

Rows of a buffer with ``vectorized_env=False`` (sync or async): each received row but reset frames is one transition
with its ``next_observation``, the env's ``terminated``/``truncated`` and ``info["env_id"]``, the env it came from (the
buffer's ``locate`` reports it).

Envs that reset inside the step that ends an episode (gymnasium's SAME_STEP and DISABLED modes, GPU simulators;
``ends_in_step``) hand over the reset frame with the step's reward and flags. With a buffer of ``vectorized_env=False``
and the final observation (:meth:`RowWriter.receive_ends_in_step`) the writer writes the final observation as the env's
row, then the reset frame as its next row, as if the env had spent a step on the reset: every transition keeps its real
successor. A vectorized buffer stores one time row of every env per step, so it gets one row per env per step, without
``info["is_last"]`` (:meth:`RowWriter.receive_resets_in_step`): the observation before the step, the action, reward,
``terminated`` and ``truncated`` as the env reported them; the next row holds the reset frame, and a final observation
the env handed over is stored nowhere (appended to the history, it is flushed with its episode by the reset frame in the
same call: no ``get()`` returns it). The buffer then ends episodes at ``terminated | truncated`` rows: a
truncated last transition is never drawn with ``with_next_obs`` and no n-step return or stack reaches past it (its
successor is not stored: one transition per truncated episode is not learned from); a terminated one is drawn with
discount 0 (its ``next_observation`` is the next episode's first frame, which no target uses). A reset after rows were
written (or the buffer detached) ends each episode at its newest row, marked ``truncated`` in place: no row is added.

Extra per-step data (:class:`~gpubuf.sources.extra.ExtraData`) is stored as ``info[name]`` in the row of the step it was
sent with (as sent, on ``is_last`` rows too; the fill on the rows a reset adds). Rows whose action the env ignored
(reset frames, and the soft reset after a life loss) echo the fill in ``step.info["action"]`` and in the history; with
``vectorized=False`` they are no transitions and are skipped."""

import numpy as np
import torch

from gpubuf._core.inputs import as_tensor, check_bool, check_cast
from gpubuf._core.staging import Staging
from gpubuf._core.transition import Transition
from gpubuf.sources.actions import ActionCodec
from gpubuf.sources.extra import ExtraData
from gpubuf.sources.layout import (
    buffer_leaves,
    check_leaves,
    chosen_leaves,
    extra_leaves,
    narrowed_obs,
    transition_sample,
)
from gpubuf.sources.staging import Step, StepStager


class RowWriter:
    """Writes the received rows of ``n_envs`` envs into an attached history and transitions buffer.

    Args:
        stager: stages each batch (its ``n_envs``, ``obs_key`` and ``device`` are the writer's).
        codec: the action space's :class:`~gpubuf.sources.actions.ActionCodec` (the fill, the float32 echo).
        extra: the caller's :class:`~gpubuf.sources.extra.ExtraData`, stored with each row.
        obs_space: the observation's ``shape`` and numpy ``dtype``.
        info_spec: ``{key: (per-env shape, numpy dtype)}`` of the env's info fields stored with each row.
        single_rows: why rows may arrive for some envs at a time (``""``: never): only buffers with
            ``vectorized_env=False`` then.
        has_final_obs: the env hands over the final observation of each episode (else: vectorized buffers only).
        ends_in_step: the env resets inside the step that ends an episode (always so without final observations): its
            vectorized buffers hold no ``info["is_last"]`` (:meth:`receive_resets_in_step`).
    """

    def __init__(self, stager: StepStager, codec: ActionCodec, extra: ExtraData, obs_space, info_spec: dict,
                 single_rows: str, has_final_obs: bool = True, ends_in_step: bool = False):
        self.has_final_obs, self.ends_in_step = has_final_obs, ends_in_step or not has_final_obs
        self.stager, self.codec, self.extra = stager, codec, extra
        self.n_envs, self.device, self.obs_space = stager.n_envs, stager.device, obs_space
        self.info_spec, self.single_rows = info_spec, single_rows
        self._staging = Staging(self.device)
        n = self.n_envs
        self._prev_obs = self._prev_rows = None  # (n_envs, *obs) device copy of each env's pending observation
        self._has_prev = np.zeros(n, dtype=bool)  # host: whether _prev_obs holds one since the reset
        self._prev_info = {k: np.zeros((n, *s), d) for k, (s, d) in info_spec.items()}
        self._fresh = np.ones(n, dtype=bool)  # the buffer holds no row of the env's current episode
        self._ended = np.zeros(n, dtype=bool)  # the env's last row ended: the env ignores its next action
        self.history = self.transitions = self.obs_storage = None  # obs_storage: the buffer's narrowed obs dtype

    # ------------------------------------------------------------------ buffers

    def attach_history(self, history) -> None:
        """Append each later row to ``history`` (``None``: none); ``n_envs`` must match."""
        if history is not None and getattr(history, "n_envs", None) != self.n_envs:
            raise ValueError(f"history: expected a HistoryBuffer with n_envs={self.n_envs}, "
                             f"got {getattr(history, 'n_envs', type(history).__name__)}")
        self.history = history

    def attach_transitions(self, tb) -> None:
        """Write each later row into ``tb`` (``None``: none), checked first; the episodes of a replaced vectorized
        buffer end (:meth:`end_episodes`)."""
        if tb is self.transitions:
            return
        if tb is not None:
            self._check_transitions(tb)
        self.end_episodes()
        self.transitions, self.obs_storage = tb, narrowed_obs(tb)
        self.extra.attach(None if tb is None else extra_leaves(buffer_leaves(tb), {*self.info_spec, "is_last",
                                                                                   "env_id"}))
        self._fresh[:] = True  # the new buffer holds no row of the current episodes

    def transition_sample(self, vectorized: bool = True, extra=None):
        """The ``Transition`` of one insert (see the source's ``transition_sample``); ``vectorized``: a bool."""
        lead = (1, self.n_envs) if check_bool("vectorized", vectorized) else (1,)
        return transition_sample(self.obs_space, self.codec.zeros, self.info_spec, lead, extra, not self.ends_in_step)

    def _check_transitions(self, tb) -> None:
        """``ValueError`` naming the first leaf of ``tb`` that differs from the rows written."""
        leaves = buffer_leaves(tb)
        vectorized = bool(tb.vectorized_env)
        if not vectorized and not self.has_final_obs:
            raise ValueError("transitions: an env without final observations needs a vectorized buffer (built from "
                             "transition_sample()): its rows mark the episode ends whose successor is unknown")
        if not vectorized and self.n_envs > 1 and getattr(tb, "n_steps", 1) > 1:
            raise ValueError(f"transitions: a buffer with vectorized_env=False stores the transitions of the "
                             f"{self.n_envs} envs interleaved, so its windows of n_steps={tb.n_steps} would mix envs; "
                             "build it with n_steps=1 (or use a vectorized buffer for windows)")
        if vectorized and self.single_rows:
            raise ValueError(f"transitions: {self.single_rows} needs a buffer with vectorized_env=False "
                             "(built from transition_sample(vectorized=False))")
        if vectorized and self.ends_in_step and not hasattr(tb, "cut_episodes"):
            raise ValueError(f"transitions: {type(tb).__name__} cannot end the episodes of rows it already handed on, "
                             "as an env that resets inside the ending step (a SAME_STEP or DISABLED autoreset vector "
                             "env, a TensorSource) needs at a reset; feed a writer from an env that keeps final "
                             "observations (an EnvPoolSource, or a VectorEnvSource of a NEXT_STEP autoreset vector "
                             "env), or step this source in the buffer's own process (a thread) with transitions= the "
                             "buffer itself")
        if vectorized and tb.n_envs != self.n_envs:
            raise ValueError(f"transitions: expected a TransitionBuffer over {self.n_envs} envs "
                             f"(build it from transition_sample()), got {tb.n_envs}")
        check_leaves(leaves, self.transition_sample(vectorized), vectorized, chosen_leaves(tb))

    def check_envs(self, n: int) -> None:
        """``ValueError`` unless a step of ``n`` envs can be written (a vectorized buffer needs every env)."""
        tb = self.transitions
        if tb is not None and tb.vectorized_env and n != self.n_envs:
            raise ValueError("env_ids: a vectorized transitions buffer stores one time row of all "
                             f"{self.n_envs} envs per step; send an action to every env, got {n}")

    # ------------------------------------------------------------------ episodes

    def end_episodes(self) -> None:
        """End the current episodes in a vectorized buffer holding rows of them (a reset, or the buffer replaced): each
        env's pending observation as an ``is_last`` row; without ``is_last`` rows (an env that resets inside the
        step), the episodes end at each env's newest row (:meth:`~gpubuf.TransitionBuffer.cut_episodes`)."""
        tb = self.transitions
        closed = getattr(getattr(tb, "storage", None), "closed", False)  # a closed storage_dir: nothing to write
        if self._has_prev.all() and not self._fresh.all() and tb is not None and tb.vectorized_env and not closed:
            n = self.n_envs
            if self.ends_in_step:
                tb.cut_episodes()
            else:
                info = {"is_last": np.ones(n, dtype=bool), **{k: v.copy() for k, v in self._prev_info.items()},
                        **self.extra.filled(n)}
                tb.insert(_row(self._prev_obs, self.codec.filled(n), np.zeros(n, np.float32), np.zeros(n, bool),
                               np.ones(n, bool), info))
            self._fresh[:] = True

    def mark_stepped(self) -> None:
        """Every env's episode as after a step of an env that resets inside it: its rows are in the buffer from the
        next step on, and no env ignores its next action (a capturable source's steps keep no host state)."""
        self._fresh[:] = False
        self._ended[:] = False

    @property
    def pending_obs(self) -> torch.Tensor | None:
        """``(n_envs, *obs)`` each env's pending observation on the device (``None`` before the first reset)."""
        return self._prev_obs

    def restart(self) -> None:
        """Every env restarts (a reset): the episodes end, nothing is pending."""
        self.end_episodes()
        self._has_prev[:] = False
        self._ended[:] = False

    # ------------------------------------------------------------------ rows

    def receive(self, obs, reward, terminated, truncated, ids: np.ndarray, first: np.ndarray, sent: np.ndarray,
                infos: dict, in_order: bool) -> Step:
        """Stage and write one received batch: ``ids (R,)`` host int64 env ids in ``[0, n_envs)``, ``first (R,)`` host
        bool reset frames, ``sent (R, *action)`` the actions executed, ``infos`` ``{key: (R, ...)}`` host arrays of
        :attr:`info_spec`; ``obs``, ``reward``, ``terminated``, ``truncated`` as the stager takes them. ``in_order``:
        ``ids`` are every env in order (whole-array updates instead of scatters)."""
        self.check_obs(obs)
        # the rows whose action the env ignored: reset frames, and the soft reset that follows an end without one
        was_ended = self._ended if in_order else self._ended[ids]
        ignored = first | was_ended if np.count_nonzero(was_ended) else first
        step = self._stage(obs, reward, terminated, truncated, ids, first, sent, infos, ignored)
        if self.transitions is not None and self._has_prev[ids].any():  # else nothing pending (after a reset)
            reward = np.asarray(reward, dtype=np.float32)
            terminated, truncated = np.asarray(terminated, dtype=bool), np.asarray(truncated, dtype=bool)
            if not self.transitions.vectorized_env:
                self._insert_single(step, ignored, sent, reward, terminated, truncated)
            elif self._has_prev.all():
                self._insert_vectorized(ids, ignored, sent, reward, terminated)
        self._remember(step, infos, in_order)
        ended = np.asarray(terminated, dtype=bool) | np.asarray(truncated, dtype=bool)
        at = slice(None) if in_order else ids
        self._fresh[at] = ignored
        self._ended[at] = ended
        return step

    def receive_ends_in_step(self, obs, reward, terminated, truncated, sent: np.ndarray, infos: dict, final,
                             final_infos: dict) -> Step:
        """Stage and write a step of every env in order whose ended envs (``terminated | truncated``, host bool
        ``(n_envs,)``) returned their reset frame in ``obs`` and their final observation in ``final`` ``(ended, *obs)``,
        ``final_infos`` ``{key: (ended, ...)}`` the info reported with it: the final observations are received first
        (the step's reward and flags), then every env's row of this step (the ended envs' reset frames, reward 0). A
        vectorized buffer gets the rows of :meth:`receive_resets_in_step` (the final observations are appended to the
        history only, where the reset frames flush them). Returns the second batch."""
        self.check_obs(obs)  # both batches fit before either is kept
        ended = terminated | truncated
        if np.count_nonzero(ended):
            self.check_obs(final)
        vectorized = self.transitions is not None and self.transitions.vectorized_env
        if np.count_nonzero(ended):
            ids, none = np.flatnonzero(ended), np.zeros(int(np.count_nonzero(ended)), bool)
            if vectorized:
                self._stage(final, reward[ids], terminated[ids], truncated[ids], ids, none, sent[ids], final_infos,
                            none)
            else:
                self.receive(final, reward[ids], terminated[ids], truncated[ids], ids, none, sent[ids], final_infos,
                             False)
        if vectorized:
            return self.receive_resets_in_step(obs, reward, terminated, truncated, sent, infos)
        if np.count_nonzero(ended):
            reward, terminated, truncated = np.where(ended, 0, reward), terminated & ~ended, truncated & ~ended
        return self.receive(obs, reward, terminated, truncated, self.stager.all_ids, ended, sent, infos, True)

    def receive_resets_in_step(self, obs, reward, terminated, truncated, sent: np.ndarray, infos: dict) -> Step:
        """Stage and write a step of every env in order whose ended envs returned their reset frame in ``obs``, into a
        vectorized buffer: each env's row holds its pending observation and this step's action, reward and flags; the
        ended envs' reset frames start new histories (reward 0 and the action fill there, as in a reset)."""
        self.check_obs(obs)
        terminated, truncated = np.asarray(terminated, dtype=bool), np.asarray(truncated, dtype=bool)
        reward = np.asarray(reward)
        ended = terminated | truncated
        some = np.count_nonzero(ended)
        shown = (np.where(ended, 0, reward), terminated & ~ended, truncated & ~ended) if some else (
            reward, terminated, truncated)
        ids = self.stager.all_ids
        step = self._stage(obs, *shown, ids, ended, sent, infos, ended)
        tb = self.transitions
        if tb is not None and self._has_prev.all():
            info = {**{k: v.copy() for k, v in self._prev_info.items()}, **self.extra.rows(ids)}
            tb.insert(_row(self._prev_obs, sent.copy(), np.asarray(reward, dtype=np.float32), terminated, truncated,
                           info))
        self._remember(step, infos, True)
        self._fresh[:] = False
        self._ended[:] = False  # no step of such an env ignores its action
        return step

    def check_obs(self, obs) -> None:
        """``TypeError`` naming ``obs`` unless the attached buffer's narrower observation storage
        (``storage_dtypes``) holds these observations, before anything of the step is kept (an observation is stored
        a step later, as the next row's)."""
        if self.obs_storage is not None:
            check_cast(as_tensor(obs, "obs"), self.obs_storage, "obs", read_device=True)

    def _stage(self, obs, reward, terminated, truncated, ids, first, sent, infos, ignored) -> Step:
        """Stage a batch (the action echo of the ``ignored`` rows: the fill) and append it to the history, flushing the
        envs whose row is a reset frame (``first``)."""
        step = self.stager.stage(obs, self.codec.echo(sent), reward, terminated, truncated, ids, first, infos, ignored)
        if self.history is not None:
            if np.count_nonzero(first):
                self.history.reset(ids[first])
            self.history.append(step.info, env_ids=ids)
        return step

    def _remember(self, step: Step, infos: dict, in_order: bool) -> None:
        """Keep each received env's observation and info fields: the pending row, stored by the next step (or a buffer
        attached before it)."""
        at = slice(None) if in_order else step.env_ids
        for key, a in infos.items():
            self._prev_info[key][at] = a
        rows, ids = step.info[self.stager.obs_key], step.env_ids  # (R, 1, *obs)
        if self._prev_obs is None:  # in the observation space's dtype: every later step's values fit it
            dtype = torch.from_numpy(np.zeros(0, self.obs_space.dtype)).dtype
            self._prev_obs = torch.zeros((self.n_envs, *rows.shape[2:]), dtype=dtype, device=self.device)
            self._prev_rows = self._prev_obs[:, None]
        if in_order:  # a plain copy (index_copy_ is ~40x slower on CPU)
            self._prev_rows.copy_(rows)
            self._has_prev[...] = True
            return
        dev_ids = self._staging.to_device(torch.from_numpy(ids), "__prev_ids__")
        self._prev_obs.index_copy_(0, dev_ids, rows[:, 0])
        self._has_prev[ids] = True

    def _insert_vectorized(self, ids, ignored, sent, reward, terminated) -> None:
        """One time row of every env, in env order; the row of a step whose action was ignored holds the last
        observation (``is_last``)."""
        order = np.argsort(ids)
        last = ignored[order]
        info = {"is_last": last, **{k: v.copy() for k, v in self._prev_info.items()}, **self.extra.rows(ids[order])}
        self.transitions.insert(_row(self._prev_obs, self.codec.fill_where(last, sent[order]),
                                     np.where(last, 0.0, reward[order]).astype(np.float32),
                                     terminated[order] & ~last, last, info))

    def _insert_single(self, step: Step, ignored, sent, reward, terminated, truncated) -> None:
        """One transition per received row that has a pending observation and an executed action."""
        ids = step.env_ids
        keep = self._has_prev[ids] & ~ignored
        if not keep.any():
            return
        rows = np.flatnonzero(keep)
        dev_ids = self._staging.to_device(torch.from_numpy(ids), "__transition_ids__")
        dev_rows = self._staging.to_device(torch.from_numpy(rows), "__transition_rows__")
        obs = step.info[self.stager.obs_key][:, 0]  # (R, *obs)
        info = {**{k: v[ids[rows]] for k, v in self._prev_info.items()}, **self.extra.rows(ids[rows]),
                "env_id": ids[rows].astype(np.int64)}  # the rows interleave the envs: each says whose it is
        self.transitions.insert(Transition(
            observation=self._prev_obs[dev_ids[dev_rows]], next_observation=obs[dev_rows], action=sent[rows],
            reward=reward[rows], terminated=terminated[rows], truncated=truncated[rows], info=info))


def _row(obs, action, reward, terminated, truncated, info: dict) -> Transition:
    """One time row ``(1, n_envs, ...)`` of a vectorized buffer from ``(n_envs, ...)`` leaves (next observations
    inferred)."""
    return Transition(observation=obs[None], action=action[None], reward=reward[None], terminated=terminated[None],
                      truncated=truncated[None], next_observation=None, info={k: v[None] for k, v in info.items()})
