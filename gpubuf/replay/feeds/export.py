"""Episodes out of a replay buffer: as dicts, a Minari dataset, or plain HDF5 files.

An episode here is what offline-RL datasets hold: ``T`` transitions and ``T + 1`` observations (the reset frame
through the final observation). A vectorized buffer holds them in one of two ways:

- an env source's rows (``info["is_last"]``: :class:`~gpubuf.EnvPoolSource`, a NEXT_STEP
  :class:`~gpubuf.VectorEnvSource`): an episode runs from the row after an ``is_last`` row to the next ``is_last``
  row, which holds the final observation; its last transition is terminated when that transition's
  ``terminated`` is set, else truncated (a time limit, or a ``reset()`` that cut it; a step the env reported
  both terminated and truncated is a termination, as the buffer stores it);
- a stored ``next_observation``: an episode ends at a ``terminated`` or ``truncated`` row, whose
  ``next_observation`` is the final one.

Only whole episodes are exported: one whose first row the ring overwrote, or that has not ended yet, is left
out, and so is every env's first stretch of rows before an episode end, unless ``first_is_reset=True`` says
that the buffer's first rows are reset frames (it was attached before the source's ``reset()``, the ring has
not wrapped since, and its rows were not loaded by ``load_state_dict``, which numbers them from 0 again).
The row after an ``is_last`` row is taken for a reset frame, which holds for a buffer that stays attached to
its source: one detached and attached again mid-episode starts each env with a partial episode there, which
this cannot tell from a whole one (drop the episodes with ``first_step`` at the re-attach). A buffer that keeps no
final observation (``vectorized_env=False``, or an env that resets inside the step that ends an episode) is refused."""

from collections.abc import Iterator

import numpy as np


def episodes(buffer, first_is_reset: bool = False) -> Iterator[dict]:
    """Every whole episode ``buffer`` holds, env by env, oldest first: ``{"env", "first_step", "observations" (T + 1,
    ...), "actions" (T, ...), "rewards" (T,), "terminations" (T,), "truncations" (T,), "infos" {name: (T + 1, ...)}}``
    numpy arrays (an ``info`` leaf's value on each observation's row; with stored next observations, the last one
    repeats the last transition's). ``ValueError`` naming ``buffer`` for a buffer that keeps no final observations."""
    state, data = _exported_data(buffer, first_is_reset)
    is_last = data.get("info['is_last']")
    M, count, pos = data["observation"].shape[0], state["count"], state["pos"]
    rows = (pos - count + np.arange(count)) % M  # oldest first
    infos = [n for n in data if n.startswith("info[") and n != "info['is_last']"]
    first_step = buffer.locate(np.asarray([rows[0] * buffer.n_envs]))[2].item() if count else 0
    for env in range(buffer.n_envs):
        col = {k: v[rows, env] for k, v in data.items()}
        ends = np.flatnonzero(col["info['is_last']"] if is_last is not None else col["terminated"] | col["truncated"])
        if first_is_reset and first_step == 0:  # the first row is a reset frame: as if an episode ended before
            ends = np.concatenate([[-1], ends])
        for a, b in zip(ends[:-1] + 1, ends[1:], strict=True):  # an episode's first and last rows
            episode = _episode(col, a, b, infos, is_last is not None)
            if episode is not None:
                yield {"env": env, "first_step": first_step + int(a), **episode}


def _exported_data(buffer, first_is_reset) -> tuple[dict, dict[str, np.ndarray]]:
    """``buffer``'s state dict and its data as numpy arrays ``(M, n_envs, ...)``, checked to cut into episodes."""
    if not callable(getattr(buffer, "state_dict", None)) or not hasattr(buffer, "locate"):
        raise TypeError(f"buffer: expected a TransitionBuffer, got {type(buffer).__name__}")
    state = buffer.state_dict()
    if not state.get("vectorized_env", False):
        raise ValueError("buffer: its transitions interleave the envs (vectorized_env=False), so they cannot be cut "
                         "into episodes; export a vectorized buffer")
    if not isinstance(first_is_reset, bool):
        raise TypeError(f"first_is_reset: expected True or False, got {first_is_reset!r}")
    data = {k: v.cpu().numpy() for k, v in state["data"].items()}
    nested = sorted(k for k in data if "[" in k and not k.startswith("info["))
    if nested:
        raise ValueError(f"buffer: nested observations or actions ({nested[:3]}) are not exported; export a buffer "
                         "of one observation and one action leaf")
    if "info['is_last']" not in data and "next_observation" not in data:
        raise ValueError("buffer: it keeps no final observations (no info['is_last'] rows of an env source and no "
                         "stored next_observation: an env that resets inside the step that ends an episode), so its "
                         "episodes cannot have T + 1 observations")
    return state, data


def _episode(col: dict[str, np.ndarray], a: int, b: int, infos: list[str], source_rows: bool) -> dict | None:
    """The episode on rows ``a..b`` of one env's columns ``col`` (oldest first): with ``source_rows`` (an env
    source's rows) ``a`` is its reset frame and ``b`` its final observation (``None`` when ``b <= a``), else ``b``'s
    stored next observation is the final one. ``infos``: the info leaves to carry."""
    sl = slice(a, b + 1)
    if source_rows:
        if b <= a:
            return None
        T = b - a
        obs = col["observation"][sl]
        term = col["terminated"][a:b].astype(bool).copy()
        trunc = np.zeros(T, bool)
        trunc[-1] = not term[-1]
        info = {n: col[n][sl] for n in infos}
    else:
        T = b - a + 1
        obs = np.concatenate([col["observation"][sl], col["next_observation"][b:b + 1]])
        term = col["terminated"][sl].astype(bool).copy()
        trunc = col["truncated"][sl].astype(bool) & ~term
        info = {n: np.concatenate([col[n][sl], col[n][b:b + 1]]) for n in infos}
    return {"observations": obs, "actions": col["action"][a:a + T],
            "rewards": col["reward"][a:a + T].astype(np.float64), "terminations": term, "truncations": trunc,
            "infos": {_info_name(n): v for n, v in info.items()}}


def _info_name(leaf: str) -> str:
    """``"latent"`` of the leaf name ``"info['latent']"``; a nested one's path joined by ``/``
    (``"info['agent']['lp']"`` -> ``"agent/lp"``)."""
    return "/".join(part.strip("'") for part in leaf[len("info["):-1].split("]["))


def to_hdf5(buffer, path, first_is_reset: bool = False) -> int:
    """Write every whole episode of ``buffer`` (:func:`episodes`, ``first_is_reset`` as there) to the HDF5 file
    ``path``: a group ``episode_<i>`` per episode with datasets ``observations``, ``actions``, ``rewards``,
    ``terminations``, ``truncations``, ``infos/<name>`` and attributes ``env``, ``first_step``; returns the number
    of episodes."""
    import h5py

    n = 0
    with h5py.File(path, "w") as f:
        for n, ep in enumerate(episodes(buffer, first_is_reset), 1):
            g = f.create_group(f"episode_{n - 1}")
            g.attrs["env"], g.attrs["first_step"] = ep["env"], ep["first_step"]
            for key in ("observations", "actions", "rewards", "terminations", "truncations"):
                g.create_dataset(key, data=ep[key])
            for name, value in ep["infos"].items():
                g.create_dataset(f"infos/{name}", data=value)
        f.attrs["total_episodes"] = n
    return n


def to_minari(buffer, dataset_id: str, *, env=None, observation_space=None, action_space=None,
              first_is_reset: bool = False, **metadata):
    """A Minari dataset ``dataset_id`` of every whole episode of ``buffer`` (:func:`episodes`, ``first_is_reset``
    as there; ``infos`` as Minari's per-observation infos), made with ``minari.create_dataset_from_buffers``: give
    the ``env`` (an id, a gymnasium env or spec) or both spaces; ``metadata`` (``author``, ``algorithm_name``, ...)
    is passed on. Returns the dataset. ``ValueError`` when the buffer holds no whole episode."""
    import minari
    from minari.data_collector.episode_buffer import EpisodeBuffer

    if env is None and (observation_space is None or action_space is None):
        raise ValueError("env: give the env (an id, a gymnasium env or EnvSpec) or both observation_space and "
                         "action_space, which a Minari dataset records")
    eps = [EpisodeBuffer(id=i, observations=ep["observations"], actions=ep["actions"],
                         rewards=list(ep["rewards"]), terminations=list(ep["terminations"]),
                         truncations=list(ep["truncations"]), infos=ep["infos"])
           for i, ep in enumerate(episodes(buffer, first_is_reset))]
    if not eps:
        raise ValueError("buffer: it holds no whole episode (from a reset frame to its final observation)")
    return minari.create_dataset_from_buffers(dataset_id, eps, env=env, observation_space=observation_space,
                                              action_space=action_space, **metadata)
