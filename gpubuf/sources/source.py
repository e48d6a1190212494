"""What every source shares: the action codec, the stager, the caller's extra data and the row writer, set up from an
env's per-env spaces, and the attached buffers as settable properties."""

from gpubuf import ops
from gpubuf._core.concurrency import CallGuard, locked
from gpubuf.sources.actions import ActionCodec
from gpubuf.sources.extra import ExtraData
from gpubuf.sources.rows import RowWriter
from gpubuf.sources.staging import StepStager


class RowSource:
    """The parts of a source that writes rows of ``n_envs`` envs (a subclass steps its env and hands each received batch
    to ``self._rows``).

    Args:
        n_envs: the envs stepped.
        action_space, observation_space: one env's spaces (``dtype``, ``shape``; ``Discrete``'s ``n``; ``Box`` bounds).
        obs_key, device, action_fill: as the subclass documents them.
        info_spec, single_rows, has_final_obs, ends_in_step: as :class:`~gpubuf.sources.rows.RowWriter` takes them.
    """

    def __init__(self, n_envs: int, action_space, observation_space, *, obs_key: str, device, action_fill,
                 info_spec: dict, single_rows: str = "", has_final_obs: bool = True, ends_in_step: bool = False):
        self.n_envs = n_envs
        self._actions = codec = ActionCodec(action_space, n_envs, action_fill)
        # the stored action of rows whose action the env ignored (its float32 echo is the stager's)
        self.action_dtype, self.action_shape, self.action_fill = codec.dtype, codec.shape, codec.fill
        self.n_actions = codec.n  # Discrete spaces: actions lie in [0, n)
        self.stager = StepStager(n_envs, obs_key, device=device, action_fill=codec.echo_fill)
        self.device = self.stager.device
        self._guard = CallGuard(self.device, ops.backend_table(self.device).tracing)  # one call at a time (threads)
        self._extra = ExtraData(n_envs, self.device)
        self._info_spec = info_spec
        self._rows = RowWriter(self.stager, codec, self._extra, observation_space, info_spec, single_rows,
                               has_final_obs, ends_in_step)

    # history and transitions: two settable properties, each the row writer's buffer, attached under the lock

    @property
    def history(self):
        """The attached :class:`~gpubuf.HistoryBuffer` (or ``None``); may be set at any time (``n_envs`` must match).
        One attached later starts with the next received row."""
        return self._rows.history

    @history.setter
    @locked
    def history(self, history) -> None:
        self._rows.attach_history(history)

    @property
    def transitions(self):
        """The attached ``TransitionBuffer`` (or ``None``); may be set at any time, also after ``reset()`` or mid-run.
        Its leaves must be those of :meth:`transition_sample` (same paths, shapes and dtypes; any further ``info``
        leaves are extra data), else a ``ValueError`` naming the leaf, before anything is attached. A buffer attached
        later stores the rows from each env's pending observation on (the one already returned by ``reset()``/the last
        step), so its first row is that observation; extra leaves of actions sent before attaching hold
        :func:`~gpubuf.sources.actions.action_fill`. Replacing or detaching (``None``) a vectorized buffer ends its
        episodes as a ``reset()`` does (one ``is_last`` row per env holding its pending observation; for an env that
        resets inside the step, each env's newest row marked ``truncated`` in place), so re-attaching it later never
        joins two stretches of a run."""
        return self._rows.transitions

    @transitions.setter
    @locked
    def transitions(self, tb) -> None:
        self._rows.attach_transitions(tb)

    @locked
    def transition_sample(self, vectorized: bool = True, extra=None):
        """A ``Transition`` shaped like one insert, to build the ``transitions`` buffer from.

        ``vectorized=True``: leaves ``(1, n_envs, ...)``, one time row per step, next observations inferred by the
        buffer, ``info["is_last"]`` marking the rows that hold no transition (not for an env that resets inside the step
        that ends an episode: its buffer ends episodes at ``terminated | truncated`` rows). ``vectorized=False`` (build
        the buffer with ``vectorized_env=False``): leaves ``(1, ...)`` with an explicit ``next_observation`` and
        ``info["env_id"]`` (int64, the env of the transition: the buffer's ``locate`` reports it); each received row is
        one transition and reset frames are skipped. Either way ``info`` holds the ``info_keys`` fields and ``extra``:
        ``{name: example}``, one env's value of each extra leaf (its shape and dtype; e.g. ``np.float32(0)`` for a
        log-probability), which every ``send``/``step`` must then pass."""
        return self._rows.transition_sample(vectorized, extra)
