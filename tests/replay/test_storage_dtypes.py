"""Per-leaf storage dtypes: a leaf stored narrower than its data sample on purpose (``storage_dtypes``).

Inserts cast on write (rounding to the nearest storage value); a value the storage dtype cannot hold raises naming
the leaf and writes nothing; samples (windows, frame stacks, next observations, n-step returns, PER) return the storage
dtype with the values a cast of the inserted rows gives, on the torch twins and through the Triton kernels (2-byte
leaves, odd sizes); state_dict, copies and a storage_dir keep the dtype. Bad ``storage_dtypes`` are refused at
construction naming the leaf."""

import copy
import pickle

import numpy as np
import pytest
import torch

from gpubuf import PrioritizedTransitionBuffer, Transition, TransitionBuffer, Unit

E = 3


def rows(g0: int, T: int, obs_dim: int = 5, scale: float = 1.0) -> Transition:
    """T rows from global step g0, every float leaf ``(g * E + env) * scale`` (an index, exact in float16 and, up
    to 256, in bfloat16), int64 action ``g``, episode ends every 7 steps."""
    g = np.arange(g0, g0 + T)[:, None]
    v = ((g * E + np.arange(E)) * scale).astype(np.float32)
    return Transition(observation=np.repeat(v[..., None], obs_dim, -1), action=np.repeat(g, E, 1).astype(np.int64),
                      reward=v.copy(), terminated=np.repeat(g % 7 == 6, E, 1), truncated=np.zeros((T, E), bool))


def narrow(dtype=torch.bfloat16, action=None):
    return {"observation": dtype} | ({"action": action} if action is not None else {})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
def test_samples_return_the_storage_dtype_with_the_cast_values(host_backend, dtype, cls):
    M = 23  # odd sizes: 23 rows of 3 envs, 5-element observations of 2 bytes
    buf = cls(M * E, 7, rows(0, 1), n_steps=1, seed=0, storage_dtypes=narrow(dtype, torch.int16))
    g = 0
    for T in (5, 9, 4, 8):  # 26 rows: the ring wraps
        buf.insert(rows(g, T))
        g += T
    for unit in (Unit.window(), Unit.transition(), Unit.frames(3, 2, next_obs=True), Unit.n_step(3, 0.5, frames=2)):
        batch = buf.sample(batch_size=11, unit=unit, key=1, with_replacement=True)
        assert batch.observation.dtype == dtype and batch.action.dtype == torch.int16
        row, env = batch.indices // E, batch.indices % E  # flat start = row * E + env
        step = row + M * ((g - 1 - row) // M)  # the global step each row holds
        newest = batch.observation.reshape(11, -1, 5)[:, -1, 0]  # a stack's newest frame is its start's
        assert torch.equal(newest, (step * E + env).to(torch.float32).to(dtype))
        assert torch.equal(batch.action.reshape(11, -1)[:, 0].long(), step)
        if unit.next_obs:
            assert batch.next_observation.dtype == dtype


def test_an_insert_rounds_to_the_nearest_storage_value():
    buf = TransitionBuffer(4 * E, 2, rows(0, 1), storage_dtypes=narrow(torch.bfloat16))
    tr = rows(0, 2)
    tr.observation = np.random.default_rng(0).standard_normal(tr.observation.shape).astype(np.float32)
    buf.insert(tr)
    stored = buf.state_dict()["data"]["observation"][:2]
    assert stored.dtype == torch.bfloat16
    assert torch.equal(stored, torch.from_numpy(tr.observation).to(torch.bfloat16))
    assert not torch.equal(stored.float(), torch.from_numpy(tr.observation))  # rounded, as documented


@pytest.mark.parametrize(("field", "value", "storage", "match"), [
    ("observation", 1e5, narrow(torch.float16), "observation.*largest torch.float16"),
    ("observation", 3.4e38, narrow(torch.bfloat16), "observation.*largest torch.bfloat16"),
    ("action", 40000, narrow(torch.float16, torch.int16), "action.*do not fit"),
])
def test_a_value_the_storage_dtype_cannot_hold_raises_and_writes_nothing(field, value, storage, match):
    buf = TransitionBuffer(8 * E, 2, rows(0, 1), storage_dtypes=storage)
    buf.insert(rows(0, 3))
    before = {k: v.clone() for k, v in buf.state_dict()["data"].items()}
    bad = rows(3, 2)
    getattr(bad, field)[1, 2] = value
    with pytest.raises(TypeError, match=match):
        buf.insert(bad)
    assert len(buf) == 3 * E
    after = buf.state_dict()["data"]
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(("storage", "error", "match"), [
    ({"obs": torch.bfloat16}, ValueError, r"storage_dtypes: 'obs' is not a leaf of data_sample; its leaves are "
                                          r"\['observation', 'action'"),
    ({"action": torch.float16}, ValueError, r"storage_dtypes\['action'\]: a float dtype \(torch.float16\) cannot "
                                            r"store the integer leaf action"),
    ({"observation": torch.int8}, ValueError, r"storage_dtypes\['observation'\]: a integer dtype"),
    ({"terminated": torch.uint8}, ValueError, r"storage_dtypes\['terminated'\]: .* the bool leaf terminated"),
    ({"reward": "bfloat16"}, TypeError, r"storage_dtypes\['reward'\]: expected a torch.dtype, got str"),
    ({"reward": torch.float8_e4m3fnuz}, TypeError, r"storage_dtypes\['reward'\]: buffers store"),
    ([("reward", torch.float16)], TypeError, r"storage_dtypes: expected a dict"),
])
def test_bad_storage_dtypes_are_refused_at_construction_naming_the_leaf(storage, error, match):
    with pytest.raises(error, match=match):
        TransitionBuffer(8 * E, 2, rows(0, 1), storage_dtypes=storage)


def test_state_dict_copies_and_pickles_keep_the_storage_dtype():
    buf = PrioritizedTransitionBuffer(9 * E, 2, rows(0, 1), seed=0, storage_dtypes=narrow(torch.bfloat16, torch.int8))
    buf.insert(rows(0, 5))
    for other in (copy.deepcopy(buf), pickle.loads(pickle.dumps(buf))):
        assert other.state_dict()["data"]["observation"].dtype == torch.bfloat16
        other.insert(rows(5, 2))  # a float32 insert still casts on write in the copy
        assert len(other) == 7 * E
    fresh = PrioritizedTransitionBuffer(9 * E, 2, rows(0, 1), storage_dtypes=narrow(torch.bfloat16, torch.int8))
    fresh.load_state_dict(buf.state_dict())
    assert torch.equal(fresh.state_dict()["data"]["observation"], buf.state_dict()["data"]["observation"])
    wide = PrioritizedTransitionBuffer(9 * E, 2, rows(0, 1))
    with pytest.raises(ValueError, match="observation"):
        wide.load_state_dict(buf.state_dict())


def test_a_storage_dir_reopens_with_its_storage_dtype_and_refuses_another(tmp_path):
    d = tmp_path / "replay"
    buf = TransitionBuffer(9 * E, 2, rows(0, 1), storage_dir=d, storage_dtypes=narrow(torch.float16))
    buf.insert(rows(0, 4))
    saved = buf.state_dict()["data"]["observation"].clone()
    buf.close()
    again = TransitionBuffer(9 * E, 2, rows(0, 1), storage_dir=d, storage_dtypes=narrow(torch.float16))
    assert len(again) == 4 * E and torch.equal(again.state_dict()["data"]["observation"], saved)
    again.close()
    with pytest.raises(ValueError, match="observation"):
        TransitionBuffer(9 * E, 2, rows(0, 1), storage_dir=d)


def test_a_source_writes_into_a_buffer_with_a_narrower_observation():
    gym = pytest.importorskip("gymnasium")
    from gpubuf import VectorEnvSource

    src = VectorEnvSource(gym.make_vec("CartPole-v1", 2, vectorization_mode="sync"), device="cpu")
    buf = TransitionBuffer(2 * 64, 4, src.transition_sample(), storage_dtypes={"observation": torch.bfloat16})
    src.transitions = buf
    src.reset(seed=0)
    seen = [src.last[0].copy()]
    for _ in range(20):
        src.step(np.zeros(2, np.int64))
        seen.append(src.last[0].copy())
    stored = buf.state_dict()["data"]["observation"][:20]  # row t: the observation step t acted on
    assert stored.dtype == torch.bfloat16 and len(buf) == 2 * 20
    assert torch.equal(stored, torch.from_numpy(np.stack(seen[:20])).to(torch.bfloat16))
    with pytest.raises(ValueError, match="transitions: leaf observation is torch.float16"):
        src.transitions = _float16_sample_buffer(src)


def _float16_sample_buffer(src):
    """A buffer whose observation leaf was built float16 from its data sample (not chosen): refused as before."""
    sample = src.transition_sample()
    sample.observation = sample.observation.astype(np.float16) if isinstance(sample.observation, np.ndarray) \
        else sample.observation.to(torch.float16)
    return TransitionBuffer(2 * 64, 4, sample)


def test_graph_inserts_cast_into_a_narrower_storage_as_inserts_do():
    a, b = (TransitionBuffer(11 * E, 2, rows(0, 1), seed=0, storage_dtypes=narrow(torch.bfloat16)) for _ in range(2))
    w = b.graph_writer()
    g = 0
    for T in (3, 5, 4, 6):
        tr = rows(g, T, scale=1.37)  # values that round
        a.insert(tr)
        w.insert(Transition(**{k: torch.as_tensor(getattr(tr, k)) for k in
                               ("observation", "action", "reward", "terminated", "truncated")}))
        g += T
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa["data"][k], sb["data"][k]) for k in sa["data"]) and len(a) == len(b)


@pytest.mark.parametrize("cls", [TransitionBuffer, PrioritizedTransitionBuffer])
def test_sample_dtypes_return_a_wider_dtype_with_the_stored_values(host_backend, cls):
    buf = cls(13 * E, 5, rows(0, 1), seed=0, storage_dtypes=narrow(torch.bfloat16, torch.int16),
              sample_dtypes={"observation": torch.float32, "action": torch.int64})
    buf.insert(rows(0, 9, scale=1.37))
    for unit in (Unit.window(), Unit.transition(), Unit.frames(2, next_obs=True), Unit.n_step(2, 0.9)):
        wide = buf.sample(5, unit, key=4, with_replacement=True)
        assert wide.observation.dtype == torch.float32 and wide.action.dtype == torch.int64
        if unit.next_obs:
            assert wide.next_observation.dtype == torch.float32
        stored = buf.state_dict()["data"]["observation"].reshape(-1, 5)  # (M * E, 5) bfloat16, flat starts
        newest = wide.observation.reshape(5, -1, 5)[:, -1]
        assert torch.equal(newest, stored[wide.indices].float())  # the stored values, exactly
    wide = buf.sample(5, Unit.window(), key=4, with_replacement=True)
    with pytest.raises(ValueError, match="out.observation: expected a contiguous torch.bfloat16 tensor"):
        buf.sample(5, Unit.window(), key=4, with_replacement=True, out=wide)  # out= holds the storage dtype
    again = copy.deepcopy(buf)
    assert again.sample(5, Unit.window(), key=4, with_replacement=True).observation.dtype == torch.float32


@pytest.mark.parametrize(("wanted", "match"), [
    ({"observation": torch.float16}, r"sample_dtypes\['observation'\]: torch.float16 cannot hold every value of "
                                     r"the leaf's storage dtype torch.bfloat16"),
    ({"observation": torch.int64}, r"sample_dtypes\['observation'\]: torch.int64 cannot hold"),
    ({"action": torch.float64}, r"sample_dtypes\['action'\]: torch.float64 cannot hold"),
    ({"obs": torch.float32}, r"sample_dtypes: 'obs' is not a leaf of the stored leaves"),
])
def test_sample_dtypes_that_cannot_hold_the_stored_values_are_refused(wanted, match):
    with pytest.raises(ValueError, match=match):
        TransitionBuffer(8 * E, 2, rows(0, 1), storage_dtypes=narrow(torch.bfloat16), sample_dtypes=wanted)


@pytest.mark.parametrize("capturable", [False, True])
def test_a_source_step_whose_observation_the_narrower_storage_cannot_hold_keeps_nothing(capturable):
    gym = pytest.importorskip("gymnasium")
    from gpubuf import TensorSource

    src = TensorSource(2, gym.spaces.Box(-1e6, 1e6, (3,), np.float32), gym.spaces.Discrete(4), final_obs=False,
                       device="cpu", capturable=capturable)
    buf = TransitionBuffer(16 * 2, 2, src.transition_sample(), storage_dtypes={"observation": torch.float16})
    src.transitions = buf
    src.reset(torch.zeros(2, 3))
    z, f, a = torch.zeros(2), torch.zeros(2, dtype=torch.bool), torch.ones(2, dtype=torch.int64)
    src.step(a, torch.full((2, 3), 1.0), z, f, f)
    if capturable:  # checked on the device: the step is dropped, and the next eager call says so
        src.step(a, torch.full((2, 3), 1e5), z, f, f)
        with pytest.raises(ValueError, match="wrote nothing"):
            len(buf)
    else:
        with pytest.raises(TypeError, match="obs: cannot store torch.float32 in the stored dtype torch.float16"):
            src.step(a, torch.full((2, 3), 1e5), z, f, f)
    for o in (2.0, 3.0):  # the source goes on, the refused step as if it never came
        src.step(a, torch.full((2, 3), o), z, f, f)
    assert len(buf) == 2 * 3
    assert buf.state_dict()["data"]["observation"][:3, 0, 0].tolist() == [0.0, 1.0, 2.0]


def test_sample_dtypes_only_widen_and_leave_a_stored_next_observation_and_returns_alone():
    tr = rows(0, 6)
    tr.next_observation = tr.observation.astype(np.float64)  # stored, wider than the observation
    sample = Transition(**{k: getattr(tr, k)[:1] for k in
                           ("observation", "action", "reward", "terminated", "truncated", "next_observation")})
    buf = TransitionBuffer(8 * E, 2, sample, storage_dtypes={"observation": torch.bfloat16, "reward": torch.float16},
                           sample_dtypes={"observation": torch.float32, "reward": torch.float16})
    tr.reward[:] = 60000
    buf.insert(tr)
    b = buf.sample(4, Unit.window(), key=0, with_replacement=True)
    assert b.observation.dtype == torch.float32 and b.next_observation.dtype == torch.float64  # its own leaf
    plain = TransitionBuffer(8 * E, 2, rows(0, 1), storage_dtypes={"reward": torch.float16},
                             sample_dtypes={"reward": torch.float16})
    big = rows(0, 6)
    big.reward[:] = 60000
    big.terminated[:] = False
    plain.insert(big)
    returns = plain.sample(4, Unit.n_step(3, 1.0), key=0, with_replacement=True).reward
    assert returns.dtype == torch.float32 and torch.isfinite(returns).all() and (returns > 65504).any()


def test_a_final_observation_step_refused_by_the_narrower_storage_writes_no_terminal_row():
    gym = pytest.importorskip("gymnasium")
    from gpubuf import TensorSource

    src = TensorSource(2, gym.spaces.Box(-1e6, 1e6, (3,), np.float32), gym.spaces.Discrete(4), final_obs=True,
                       device="cpu")
    buf = TransitionBuffer(32, 2, src.transition_sample(vectorized=False), vectorized_env=False,
                           storage_dtypes={"observation": torch.float16})
    src.transitions = buf
    src.reset(np.zeros((2, 3), np.float32))
    z, f = np.zeros(2, np.float32), np.zeros(2, bool)
    src.step(np.array([1, 1]), np.ones((2, 3), np.float32), z, f, f, final_obs=np.zeros((2, 3), np.float32))
    n = len(buf)
    obs = np.full((2, 3), 2.0, np.float32)
    obs[0] = 1e5  # env 0's reset frame after its episode ended
    with pytest.raises(TypeError, match="obs: cannot store"):
        src.step(np.array([1, 1]), obs, z, np.array([True, False]), f, final_obs=np.full((2, 3), 2.0, np.float32))
    assert len(buf) == n
