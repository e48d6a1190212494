"""Episodes in (gpubuf.datasets): a Minari dataset or an HDF5 file written from a buffer that a real gymnasium vector
env filled, loaded into a fresh buffer, must export again as exactly the same episodes; bad episodes and buffers that
cannot hold them are refused, naming what is wrong, before anything of the episode is written."""

import dataclasses

import numpy as np
import pytest
import torch
from extras import needs

gym = needs("gymnasium")
from test_export import assert_same, run  # noqa: E402

from gpubuf import Transition, TransitionBuffer, Unit, datasets, export  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def fresh(buf, n_envs: int, rows: int = 400) -> TransitionBuffer:
    """An empty buffer shaped like ``buf`` but with ``n_envs`` envs and ``rows`` rows per env."""
    sample = buf.state_dict()["data"]
    tr = {k: v[:1, :1].expand(1, n_envs, *v.shape[2:]).clone() for k, v in sample.items()}
    info = {k[len("info['"):-2]: v for k, v in tr.items() if k.startswith("info[")}
    return TransitionBuffer(n_envs * rows, 4, Transition(observation=tr["observation"], action=tr["action"],
                                                         reward=tr["reward"], terminated=tr["terminated"],
                                                         truncated=tr["truncated"], info=info), device="cpu")


def assert_same_episodes(got: list, want: list, ordered: bool) -> None:
    assert len(got) == len(want)
    if not ordered:  # E lanes take the episodes in turn: match each one by its first observation
        by_start = {w["observations"][0].tobytes() + w["observations"][-1].tobytes(): w for w in want}
        want = [by_start[g["observations"][0].tobytes() + g["observations"][-1].tobytes()] for g in got]
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
        np.testing.assert_array_equal(g["infos"]["t"], w["infos"]["t"])


@pytest.mark.parametrize("n_envs", [1, 4])
def test_hdf5_round_trip_into_one_env_or_several(tmp_path, n_envs):
    needs("h5py")
    buf, _ = run()
    eps = list(export.episodes(buf, first_is_reset=True))
    export.to_hdf5(buf, tmp_path / "eps.h5", first_is_reset=True)
    loaded = fresh(buf, n_envs)
    assert datasets.load_episodes(loaded, datasets.from_hdf5(tmp_path / "eps.h5")) == len(eps)
    again = list(export.episodes(loaded, first_is_reset=True))
    assert_same_episodes(again, eps, ordered=n_envs == 1)
    rows = sum(len(e["rewards"]) + 1 for e in eps)  # T transition rows and one final observation each
    assert len(loaded) == rows if n_envs == 1 else rows <= len(loaded) < rows + n_envs * 60


def test_minari_round_trip_and_sampling_never_starts_at_a_final_observation(host_backend, tmp_path, monkeypatch):
    needs("minari")
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    buf, _ = run()
    eps = list(export.episodes(buf, first_is_reset=True))
    export.to_minari(buf, "gpubuf/load-test-v0", env="CartPole-v1", first_is_reset=True)
    loaded = fresh(buf, 2)
    assert datasets.load_episodes(loaded, datasets.from_minari("gpubuf/load-test-v0")) == len(eps)
    assert_same_episodes(list(export.episodes(loaded, first_is_reset=True)), eps, ordered=False)
    batch = loaded.sample(batch_size=256, unit=Unit.transition(), key=0, with_replacement=True)
    assert not batch.info["is_last"].any()  # the final-observation and filler rows hold no transition
    assert torch.isfinite(batch.action.float()).all()


def test_episodes_into_a_buffer_with_stored_next_observations():
    needs("h5py")
    buf, _ = run()
    eps = list(export.episodes(buf, first_is_reset=True))
    obs = buf.state_dict()["data"]["observation"][:1, :1]
    sample = Transition(observation=obs, action=torch.zeros(1, 1, dtype=torch.int64), reward=torch.zeros(1, 1),
                        terminated=torch.zeros(1, 1, dtype=torch.bool), truncated=torch.zeros(1, 1, dtype=torch.bool),
                        next_observation=obs, info={"t": torch.zeros(1, 1, dtype=torch.int64)})
    loaded = TransitionBuffer(400, 4, sample, device="cpu")
    datasets.load_episodes(loaded, eps)
    again = list(export.episodes(loaded, first_is_reset=True))
    for g, w in zip(again, eps, strict=True):
        assert_same(g, w)
    assert len(loaded) == sum(len(e["rewards"]) for e in eps)


def test_a_bad_episode_is_refused_naming_it_and_writes_nothing_of_it():
    buf, _ = run()
    eps = list(export.episodes(buf, first_is_reset=True))[:3]
    loaded = fresh(buf, 1)
    short = dict(eps[1], observations=eps[1]["observations"][:-1])
    with pytest.raises(ValueError, match=r"episodes\[1\]: expected T >= 1 transitions and T \+ 1 observations"):
        datasets.load_episodes(loaded, [eps[0], short, eps[2]])
    assert len(loaded) == len(eps[0]["rewards"]) + 1  # episode 0 only
    no_info = dict(eps[0], infos={})
    with pytest.raises(ValueError, match=r"episodes\[0\]: the buffer stores infos \['t'\]; this episode lacks"):
        datasets.load_episodes(fresh(buf, 1), [no_info])
    with pytest.raises(ValueError, match=r"episodes\[0\]\['rewards'\]: expected shape"):
        datasets.load_episodes(fresh(buf, 1), [dict(eps[0], rewards=eps[0]["rewards"][:-1])])
    with pytest.raises(ValueError, match=r"episodes\[0\]: expected a dict with keys"):
        datasets.load_episodes(fresh(buf, 1), [{"observations": 1}])


def test_buffers_that_cannot_hold_episodes_are_refused():
    buf, _ = run()
    eps = list(export.episodes(buf, first_is_reset=True))[:1]
    plain = TransitionBuffer(40, 4, Transition(observation=torch.zeros(1, 1, 4), action=torch.zeros(1, 1),
                                               reward=torch.zeros(1, 1), terminated=torch.zeros(1, 1, dtype=bool),
                                               truncated=torch.zeros(1, 1, dtype=bool)))
    with pytest.raises(ValueError, match="buffer: it keeps no final observations"):
        datasets.load_episodes(plain, eps)
    lanes = TransitionBuffer(40, 4, dataclasses.replace(
        Transition(observation=torch.zeros(1, 2, 4), action=torch.zeros(1, 2), reward=torch.zeros(1, 2),
                   terminated=torch.zeros(1, 2, dtype=bool), truncated=torch.zeros(1, 2, dtype=bool)),
        next_observation=torch.zeros(1, 2, 4)))
    with pytest.raises(ValueError, match="buffer: a vectorized buffer of 2 envs with stored next observations"):
        datasets.load_episodes(lanes, eps)
    with pytest.raises(TypeError, match="buffer: expected a TransitionBuffer, got list"):
        datasets.load_episodes([], eps)


def test_loading_after_rows_of_an_open_episode_ends_it_first():
    buf, _ = run()
    eps = list(export.episodes(buf, first_is_reset=True))[:3]
    loaded = fresh(buf, 1)
    loaded.insert(run_rows(buf, 3))  # 3 rows, no episode end
    datasets.load_episodes(loaded, eps)
    batch = loaded.sample(512, Unit.transition(), key=0, with_replacement=True)
    old = batch.indices < 3  # rows 0..2: the old stretch, cut at its newest row
    assert not (old & (batch.indices == 2)).any()  # its newest row has no successor: never a transition
    assert loaded.state_dict()["data"]["truncated"][2, 0]


def run_rows(buf, n: int) -> Transition:
    """``buf``'s first ``n`` rows of env 0, as an insert into one env (no episode ends)."""
    d = {k: v[:n, :1] for k, v in buf.state_dict()["data"].items()}
    return Transition(observation=d["observation"], action=d["action"], reward=d["reward"],
                      terminated=torch.zeros_like(d["terminated"]), truncated=torch.zeros_like(d["truncated"]),
                      info={"is_last": torch.zeros_like(d["info['is_last']"]), "t": d["info['t']"]})


def test_an_unsigned_action_takes_a_fill_it_can_hold():
    buf, _ = run()
    eps = list(export.episodes(buf, first_is_reset=True))[:4]
    d = buf.state_dict()["data"]
    sample = Transition(observation=d["observation"][:1, :1], action=torch.zeros(1, 1, dtype=torch.uint8),
                        reward=d["reward"][:1, :1], terminated=d["terminated"][:1, :1],
                        truncated=d["truncated"][:1, :1],
                        info={"is_last": d["info['is_last']"][:1, :1], "t": d["info['t']"][:1, :1]})
    loaded = TransitionBuffer(400, 4, sample, device="cpu")
    datasets.load_episodes(loaded, eps)
    got = loaded.state_dict()["data"]
    assert (got["action"][got["info['is_last']"]] == 255).all()


def test_malformed_files_and_layouts_are_refused_naming_what(tmp_path):
    h5py = needs("h5py")
    buf, _ = run()
    eps = list(export.episodes(buf, first_is_reset=True))[:2]
    path = tmp_path / "eps.h5"
    export.to_hdf5(buf, path, first_is_reset=True)
    with h5py.File(path, "a") as f:
        f.create_group("episode_final")
    with pytest.raises(ValueError, match=r"path: .* holds groups \['episode_final'\] that are not episode_<i>"):
        list(datasets.from_hdf5(path))
    wide = dict(eps[1], observations=np.concatenate([eps[1]["observations"]] * 2, 1))
    loaded = fresh(buf, 2)
    with pytest.raises(ValueError, match=r"episodes\[1\]\['observations'\]: expected \(4,\) per step"):
        datasets.load_episodes(loaded, [eps[0], wide])
    assert len(loaded) == 0
    d = buf.state_dict()["data"]
    both = Transition(observation=d["observation"][:1, :1], action=d["action"][:1, :1], reward=d["reward"][:1, :1],
                      terminated=d["terminated"][:1, :1], truncated=d["truncated"][:1, :1],
                      next_observation=d["observation"][:1, :1], info={"is_last": d["info['is_last']"][:1, :1]})
    with pytest.raises(ValueError, match="buffer: it stores both next_observation and info\\['is_last'\\] rows"):
        datasets.load_episodes(TransitionBuffer(40, 4, both), eps)


def test_a_load_refused_at_its_first_rows_leaves_an_open_episode_uncut():
    lead = (1, 1)
    sample = Transition(observation=torch.zeros(*lead, 2), action=torch.zeros(lead, dtype=torch.int64),
                        reward=torch.zeros(lead), terminated=torch.zeros(lead, dtype=torch.bool),
                        truncated=torch.zeros(lead, dtype=torch.bool), info={"is_last": torch.zeros(lead, dtype=bool)})
    buf = TransitionBuffer(64, 1, sample, storage_dtypes={"observation": torch.float16})
    buf.insert(Transition(observation=np.ones((3, 1, 2), np.float32), action=np.zeros((3, 1), np.int64),
                          reward=np.zeros((3, 1), np.float32), terminated=np.zeros((3, 1), bool),
                          truncated=np.zeros((3, 1), bool), info={"is_last": np.zeros((3, 1), bool)}))
    before = {k: v.clone() for k, v in buf.state_dict()["data"].items()}
    ep = {"observations": np.full((4, 2), 1e5, np.float32), "actions": np.zeros(3, np.int64),
          "rewards": np.zeros(3, np.float32), "terminations": np.array([False, False, True]),
          "truncations": np.zeros(3, bool), "infos": {}}
    with pytest.raises(TypeError, match="observation"):
        datasets.load_episodes(buf, [ep])
    after = buf.state_dict()["data"]
    assert len(buf) == 3 and all(torch.equal(before[k], after[k]) for k in before)
