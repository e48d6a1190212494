"""Episodes into a replay buffer: from a Minari dataset, an HDF5 file, or any iterable of episode dicts.

An episode is what :mod:`gpubuf.replay.feeds.export` writes and offline-RL datasets hold: ``T`` transitions and
``T + 1`` observations (the reset frame through the final one), ``actions`` / ``rewards`` / ``terminations`` /
``truncations`` ``(T, ...)`` and per-observation ``infos`` ``{name: (T + 1, ...)}``. :func:`load_episodes` writes them
in the row convention of the buffer it is given:

- a buffer built like an env source's (an ``info["is_last"]`` leaf, e.g. from ``EnvPoolSource.transition_sample()``):
  per episode ``T`` transition rows (observation, action, reward, ``terminated``; ``truncated`` False), then one
  ``is_last`` row holding the final observation, the action fill, reward 0 and ``truncated`` set, as the sources write
  an episode end. A vectorized buffer of ``E`` envs takes the episodes on its env lanes in turn (each to the lane with
  the fewest rows), and lanes that end shorter are filled with ``is_last`` rows (observation 0), which hold no
  transition and are never sampled;
- a buffer that stores ``next_observation``: ``T`` rows per episode, each transition with its next observation and
  the episode's ``terminated`` / ``truncated`` on its last row. A vectorized one must have one env (its lanes cannot be
  filled without writing transitions that never happened).

Round trip: a buffer's :func:`~gpubuf.replay.feeds.export.episodes` loaded into a buffer of the same configuration
export again as the same episodes. ``h5py`` (HDF5) and ``minari`` are optional, imported when used."""

from collections.abc import Iterable, Iterator

import numpy as np
import torch

from gpubuf._core.transition import Transition

KEYS = ("observations", "actions", "rewards", "terminations", "truncations")


def from_hdf5(path) -> Iterator[dict]:
    """The episodes of an HDF5 file written by :func:`~gpubuf.replay.feeds.export.to_hdf5` (groups ``episode_<i>`` in
    order, datasets ``observations``, ``actions``, ``rewards``, ``terminations``, ``truncations``, ``infos/<name>``)."""
    import h5py

    with h5py.File(path, "r") as f:
        numbered = {k: k[len("episode_"):] for k in f if k.startswith("episode_")}
        odd = [k for k, n in numbered.items() if not n.isdigit()]
        if odd:
            raise ValueError(f"path: {str(path)!r} holds groups {odd[:3]} that are not episode_<i>, as to_hdf5 "
                             "names its episodes")
        for name in sorted(numbered, key=lambda k: int(numbered[k])):
            g = f[name]
            missing = [k for k in KEYS if k not in g]
            if missing:
                raise ValueError(f"path: {name} of {str(path)!r} lacks datasets {missing}")
            infos = {}
            if "infos" in g:
                g["infos"].visititems(lambda key, v, out=infos: out.update({key: v[()]}) if hasattr(v, "shape")
                                      else None)
            yield {**{k: g[k][()] for k in KEYS}, "infos": infos}


def from_minari(dataset) -> Iterator[dict]:
    """The episodes of a Minari dataset: a ``MinariDataset`` or the id of a local one (``minari.load_dataset``)."""
    import minari

    if isinstance(dataset, str):
        dataset = minari.load_dataset(dataset)
    for ep in dataset.iterate_episodes():
        if isinstance(ep.observations, dict) or isinstance(ep.actions, dict):
            raise ValueError("dataset: dict observations or actions are not loaded; load a dataset of one observation "
                             "and one action array")
        infos = {k: np.asarray(v) for k, v in (ep.infos or {}).items() if not isinstance(v, dict)}
        yield {"observations": ep.observations, "actions": ep.actions, "rewards": ep.rewards,
               "terminations": ep.terminations, "truncations": ep.truncations, "infos": infos}


def load_episodes(buffer, episodes: Iterable[dict], *, action_fill=None) -> int:
    """Insert every episode of ``episodes`` into ``buffer`` (module docstring for the rows); returns the episodes
    loaded. ``action_fill``: the action of an ``is_last`` row (default NaN for a float action, -1 for a signed integer
    one, the largest value of an unsigned one). A buffer holding rows has its open episodes ended at their newest
    rows first (``cut_episodes``), so no window joins them to the first loaded episode. Each episode is checked whole
    before anything of it is written (``ValueError`` naming the episode and key); then its rows go through
    ``buffer.insert`` (one env: an episode at a time; ``E`` envs: the lanes at the end, in blocks of the ring's rows),
    which checks and casts them as any insert (a value the buffer cannot store raises there, with the blocks before it
    written). A ring smaller than the data keeps the newest rows."""
    layout = _Layout(buffer, action_fill)
    n = 0
    for n, ep in enumerate(episodes, 1):
        layout.add(_checked(ep, n - 1, layout.infos, layout.shapes))
    layout.flush()
    return n


def _checked(ep: dict, i: int, infos: list, shapes: dict) -> dict:
    """Episode ``i`` as numpy arrays, its lengths checked (``T + 1`` observations and infos, ``T`` of the rest) and
    its observations' and actions' shapes per step (``shapes``: ``{key: the buffer's leaf shape}``)."""
    if not isinstance(ep, dict) or any(k not in ep for k in KEYS):
        raise ValueError(f"episodes[{i}]: expected a dict with keys {list(KEYS)}, got "
                         f"{sorted(ep) if isinstance(ep, dict) else type(ep).__name__}")
    out = {k: np.asarray(ep[k]) for k in KEYS}
    T = len(out["actions"])
    if T < 1 or len(out["observations"]) != T + 1:
        raise ValueError(f"episodes[{i}]: expected T >= 1 transitions and T + 1 observations, got "
                         f"{T} actions and {len(out['observations'])} observations")
    for k in KEYS[2:]:
        if out[k].shape != (T,):
            raise ValueError(f"episodes[{i}]['{k}']: expected shape ({T},), got {out[k].shape}")
    for k, shape in shapes.items():
        if out[k].shape[1:] != shape:
            raise ValueError(f"episodes[{i}]['{k}']: expected {shape} per step, as the buffer stores it, got "
                             f"{out[k].shape[1:]}")
    given = ep.get("infos") or {}
    missing = [name for name in infos if name not in given]
    if missing:
        raise ValueError(f"episodes[{i}]: the buffer stores infos {infos}; this episode lacks {missing}")
    out["infos"] = {name: np.asarray(given[name]) for name in infos}
    for name, v in out["infos"].items():
        if len(v) != T + 1:
            raise ValueError(f"episodes[{i}]['infos']['{name}']: expected T + 1 = {T + 1} values, got {len(v)}")
    return out


class _Layout:
    """The rows of one buffer's convention, collected per env lane and inserted as ``(T, E, ...)`` blocks."""

    def __init__(self, buffer, action_fill):
        if not hasattr(buffer, "config") or not callable(getattr(buffer, "insert", None)):
            raise TypeError(f"buffer: expected a TransitionBuffer, got {type(buffer).__name__}")
        self.buffer, config = buffer, buffer.config
        names = [leaf.name for leaf in config.leaves]
        nested = [n for n in names if "[" in n and (not n.startswith("info[") or n.count("[") > 1)]
        if nested:
            raise ValueError(f"buffer: nested leaves ({nested[:3]}) are not loaded; load into a buffer of one "
                             "observation, one action and flat info leaves")
        self.source_rows, self.next_obs = "info['is_last']" in names, "next_observation" in names
        if self.source_rows and self.next_obs:
            raise ValueError("buffer: it stores both next_observation and info['is_last'] rows; load into a buffer "
                             "of one of the two layouts (an env source's rows, or stored next observations)")
        if not self.source_rows and not self.next_obs:
            raise ValueError("buffer: it keeps no final observations (no info['is_last'] leaf, as an env source's "
                             "buffer has, and no next_observation), so an episode's last observation has no row")
        self.E = config.n_envs if config.vectorized_env else 1
        if self.next_obs and not self.source_rows and self.E > 1:
            raise ValueError(f"buffer: a vectorized buffer of {self.E} envs with stored next observations cannot take "
                             "episodes of different lengths on its env lanes; build it with one env or with "
                             "info['is_last'] rows")
        self.infos = [_info_key(n) for n in names if n.startswith("info[") and n != "info['is_last']"]
        action = config.by_path[("action",)].dtype
        self.fill = action_fill if action_fill is not None else _default_fill(action)
        self.shapes = {"observations": config.by_path[("observation",)].shape,
                       "actions": config.by_path[("action",)].shape}
        self.vectorized = config.vectorized_env
        self.written = False  # whether anything was inserted yet
        self.lanes: list[list[dict]] = [[] for _ in range(self.E)]
        self.lengths = [0] * self.E

    def add(self, ep: dict) -> None:
        """Queue one checked episode's rows on the shortest lane (written now when there is one lane)."""
        rows = self._source_rows(ep) if self.source_rows else self._transition_rows(ep)
        lane = int(np.argmin(self.lengths))
        self.lanes[lane].append(rows)
        self.lengths[lane] += len(rows["reward"])
        if self.E == 1:
            self.flush()

    def _source_rows(self, ep: dict) -> dict:
        T, actions = len(ep["actions"]), ep["actions"]
        fill = np.full((1, *actions.shape[1:]), self.fill, np.result_type(actions.dtype, np.asarray(self.fill)))
        last = np.arange(T + 1) == T  # the row holding the final observation
        return {"observation": ep["observations"], "action": np.concatenate([actions, fill]),
                "reward": np.concatenate([ep["rewards"], [0]]), "terminated": np.concatenate([ep["terminations"],
                                                                                              [False]]),
                "truncated": last, "info": {"is_last": last, **ep["infos"]}}

    def _transition_rows(self, ep: dict) -> dict:
        term = ep["terminations"].astype(bool)
        return {"observation": ep["observations"][:-1], "next_observation": ep["observations"][1:],
                "action": ep["actions"], "reward": ep["rewards"], "terminated": term,
                "truncated": ep["truncations"].astype(bool) & ~term,
                "info": {k: v[:-1] for k, v in ep["infos"].items()}}

    def flush(self) -> None:
        """Insert the queued rows: every lane padded to the longest with ``is_last`` rows, in blocks the ring holds."""
        longest = max(self.lengths)
        if longest == 0:
            return
        lanes = [_concat(lane) for lane in self.lanes]
        template = next(lane for lane in lanes if lane is not None)
        lanes = [_pad(lane, template, longest, self.fill) for lane in lanes]
        M = self.buffer.config.max_rows
        for a in range(0, longest, M):
            block = _tree_map(lambda *xs, a=a: np.stack([x[a:a + M] for x in xs], 1), *lanes)
            if not self.vectorized:
                block = _tree_map(lambda x: x[:, 0], block)
            rows = Transition(**{k: _nest(v) for k, v in block.items()})
            if not self.written and len(self.buffer):  # an episode still open at the newest rows ends there, before
                self.buffer.config.rows(rows)           # the first loaded reset frame (once the rows check out)
                self.buffer.cut_episodes()
            self.written = True
            self.buffer.insert(rows)
        self.lanes, self.lengths = [[] for _ in range(self.E)], [0] * self.E


def _default_fill(dtype) -> float | int:
    """The action of an ``is_last`` row: NaN for a float action, -1 for a signed integer one, the largest value of an
    unsigned one (-1 wrapped), ``False`` for a bool one."""
    if dtype.is_floating_point:
        return np.nan
    if dtype == torch.bool:
        return False
    return -1 if torch.iinfo(dtype).min < 0 else torch.iinfo(dtype).max


def _info_key(leaf: str) -> str:
    """``"lives"`` of the leaf name ``"info['lives']"``."""
    return leaf[len("info['"):-2]


def _nest(v):
    return {k: _nest(x) for k, x in v.items()} if isinstance(v, dict) else v


def _tree_map(fn, *trees):
    first = trees[0]
    if isinstance(first, dict):
        return {k: _tree_map(fn, *(t[k] for t in trees)) for k in first}
    return fn(*trees)


def _concat(episodes: list) -> dict | None:
    return _tree_map(lambda *xs: np.concatenate(xs), *episodes) if episodes else None


def _pad(lane: dict | None, template: dict, length: int, fill) -> dict:
    """``lane`` extended to ``length`` rows by ``is_last`` rows (zeros; the action fill, ``truncated`` set)."""
    have = 0 if lane is None else len(lane["reward"])
    if have == length:
        return lane

    def pad(path, x):
        extra = np.zeros((length - have, *x.shape[1:]), x.dtype)
        if path in (("truncated",), ("info", "is_last")):
            extra[:] = True
        elif path == ("action",):
            extra[:] = fill
        return extra if lane is None else np.concatenate([_get(lane, path), extra])

    return _map_paths(pad, template)


def _get(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def _map_paths(fn, tree: dict, path: tuple = ()) -> dict:
    return {k: _map_paths(fn, v, path + (k,)) if isinstance(v, dict) else fn(path + (k,), v) for k, v in tree.items()}

