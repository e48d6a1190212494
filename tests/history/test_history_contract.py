"""HistoryBuffer's documented contract, one test per behaviour, on both backends (torch twins and
Triton kernels): each env keeps its last ``max_len`` entries, ``env_ids`` route rows, ``get`` returns
strided frames padded with the oldest strided entry and zero-padded action blocks, ``out=``, ``keys=``,
``reset``, ``num_strided``, ``state_dict`` and the argument checks."""

import numpy as np
import pytest
import torch
from dlpack_only import DlpackOnly
from fixtures import assert_gets_equal
from history_model import HistoryModel
from snapshots import assert_unchanged, snapshot

from gpubuf import HistoryBuffer


def steps(buf, model, n_steps, n_envs, start=0, env_ids=None):
    """Append index-valued steps: pixels (R, 1, 2, 3) == step, action (R, 1, 2) == step + env/100."""
    rows = n_envs if env_ids is None else len(env_ids)
    envs = np.arange(n_envs) if env_ids is None else np.asarray(env_ids)
    for t in range(start, start + n_steps):
        info = {
            "pixels": np.full((rows, 1, 2, 3), t, dtype=np.uint8),
            "action": (t + envs / 100).astype(np.float32).reshape(rows, 1, 1).repeat(2, axis=2),
        }
        buf.append(info, env_ids=env_ids)
        model.append(info, env_ids=env_ids)



def make(n_envs=3, max_len=7, ab=2, block_keys=("action",), device="cpu"):
    return HistoryBuffer(n_envs, max_len, ab, block_keys, device=device), HistoryModel(n_envs, max_len, ab, block_keys)


# ------------------------------------------------------------------ construction


@pytest.mark.parametrize("arg", ["n_envs", "max_len", "action_block"])
@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "3"])
def test_sizes_must_be_positive_ints(arg, bad):
    kwargs = dict(n_envs=2, max_len=3, action_block=1)
    kwargs[arg] = bad
    with pytest.raises(ValueError, match=f"{arg}: expected a positive int, got {bad!r}"):
        HistoryBuffer(**kwargs)


def test_block_keys_bare_string_is_rejected():
    with pytest.raises(TypeError, match="block_keys: expected an iterable of key names"):
        HistoryBuffer(2, 3, 1, "action")


def test_device_none_means_cuda_when_available():
    buf = HistoryBuffer(2, 3)
    assert buf.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


# ------------------------------------------------------------------ append


def test_each_env_keeps_its_last_max_len_entries(backend, device):
    buf, model = make(max_len=4, ab=1, device=device)
    steps(buf, model, 9, 3)
    out = buf.get(4)
    assert out["pixels"][:, :, 0, 0].tolist() == [[5, 6, 7, 8]] * 3
    assert_gets_equal(out, model.get(4))
    assert len(buf) == 4


def test_append_env_ids_routes_rows(backend, device):
    buf, model = make(ab=1, device=device)
    steps(buf, model, 1, 3)
    buf.append({"pixels": np.stack([np.full((1, 2, 3), 50), np.full((1, 2, 3), 20)]).astype(np.uint8),
                "action": np.zeros((2, 1, 2), np.float32)}, env_ids=[2, 0])
    assert buf.num_strided() == [2, 1, 2]
    assert buf.get(1, env_ids=[0, 1, 2])["pixels"][:, 0, 0, 0].tolist() == [20, 0, 50]


def test_append_duplicate_env_ids_append_in_row_order(backend, device):
    buf, model = make(max_len=3, ab=1, device=device)
    steps(buf, model, 1, 3)
    steps(buf, model, 3, 3, start=1, env_ids=[1, 1, 0])
    steps(buf, model, 2, 3, start=4, env_ids=[2, 2, 2, 2, 2])  # more rows than max_len for env 2
    assert_gets_equal(buf.get(3), model.get(3))
    assert buf.num_strided() == [3, 3, 3]


def test_scalar_and_time_dim_shapes(backend, device):
    buf = HistoryBuffer(2, 5, 1, device=device)
    for t in range(3):
        buf.append({"r": np.array([t, 10 + t], np.float32), "v": np.full((2, 3), t, np.int32)})
    out = buf.get(2)
    assert out["r"].shape == (2, 2) and out["r"].tolist() == [[1, 2], [11, 12]]
    assert out["v"].shape == (2, 6)  # dim 1 is time: (n_envs, 3) is T=3 steps of scalars
    assert out["v"][0].tolist() == [1, 1, 1, 2, 2, 2]


def test_numeric_scalars_broadcast(backend, device):
    buf = HistoryBuffer(3, 4, device=device)
    buf.append({"r": 1.5, "done": np.bool_(True), "k": 7})
    out = buf.get(1)
    assert out["r"].tolist() == [[1.5]] * 3 and out["r"].dtype == torch.float32
    assert out["done"].dtype == torch.bool and out["k"].dtype == torch.int64


@pytest.mark.parametrize("bad", ["text", [1, 2, 3], {"a": 1}, None, np.array(["a", "b", "c"])])
def test_non_numeric_values_raise_type_error(bad):
    buf = HistoryBuffer(3, 4, device="cpu")
    with pytest.raises(TypeError, match="^obs: expected"):
        buf.append({"obs": bad})
    assert buf.keys == ()


def test_inputs_numpy_torch_and_dlpack(backend, device):
    buf = HistoryBuffer(2, 4, device=device)
    buf.append({"x": np.array([[1], [2]], np.int32)})
    buf.append({"x": torch.tensor([[3], [4]], dtype=torch.int32)})
    buf.append({"x": DlpackOnly(np.array([[5], [6]], np.int32))})
    assert buf.get(3)["x"].tolist() == [[1, 3, 5], [2, 4, 6]]


def test_inputs_are_copied_not_viewed(backend, device):
    buf = HistoryBuffer(2, 4, device=device)
    arr = np.array([[1], [2]], np.int32)
    buf.append({"x": arr})
    arr[:] = 99
    assert buf.get(1)["x"].tolist() == [[1], [2]]


# ------------------------------------------------------------------ fixed key set, shapes, dtypes


def test_missing_or_extra_key_raises_and_writes_nothing(backend, device):
    buf, model = make(device=device)
    steps(buf, model, 2, 3)
    before = snapshot(buf)
    with pytest.raises(ValueError, match=r"missing \['action'\]"):
        buf.append({"pixels": np.zeros((3, 1, 2, 3), np.uint8)})
    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        buf.append({"pixels": np.zeros((3, 1, 2, 3), np.uint8), "action": np.zeros((3, 1, 2), np.float32),
                    "extra": np.zeros(3)})
    assert_unchanged(buf, before)


def test_changed_shape_raises_value_error(backend, device):
    buf, model = make(device=device)
    steps(buf, model, 1, 3)
    before = snapshot(buf)
    with pytest.raises(ValueError, match=r"pixels: expected per-env shape \(1, 2, 3\), got \(2, 2, 3\)"):
        buf.append({"pixels": np.zeros((3, 2, 2, 3), np.uint8), "action": np.zeros((3, 1, 2), np.float32)})
    assert_unchanged(buf, before)


def test_unsafe_dtype_raises_type_error(backend, device):
    buf, model = make(device=device)
    steps(buf, model, 1, 3)
    before = snapshot(buf)
    with pytest.raises(TypeError, match="pixels: cannot store torch.float32 in the stored dtype torch.uint8"):
        buf.append({"pixels": np.zeros((3, 1, 2, 3), np.float32), "action": np.zeros((3, 1, 2), np.float32)})
    assert_unchanged(buf, before)
    buf.append({"pixels": np.zeros((3, 1, 2, 3), np.uint8), "action": np.zeros((3, 1, 2), np.float64)})  # safe


# ------------------------------------------------------------------ get


def test_get_none_when_n_nonpositive_or_env_empty(backend, device):
    buf, model = make(device=device)
    assert buf.get(3) is None  # nothing appended yet
    steps(buf, model, 2, 3)
    assert buf.get(0) is None and buf.get(-1) is None
    buf.reset([1])
    assert buf.get(2) is None
    assert buf.get(2, env_ids=[0, 2]) is not None


def test_get_env_ids_duplicates_negatives_and_empty(backend, device):
    buf, model = make(device=device)
    steps(buf, model, 5, 3)
    assert_gets_equal(buf.get(3, env_ids=[2, 0, 2]), model.get(3, [2, 0, 2]))
    assert_gets_equal(buf.get(3, env_ids=[-1, -3]), model.get(3, [2, 0]))
    empty = buf.get(3, env_ids=[])
    assert empty["pixels"].shape == (0, 3, 2, 3) and empty["action"].shape == (0, 2, 4)
    with pytest.raises(IndexError, match=r"env_ids: ids must lie in \[-3, 3\), got \[3\]"):
        buf.get(3, env_ids=[0, 3])


def test_strided_positions_and_padding_with_oldest_strided_entry(backend, device):
    buf = HistoryBuffer(1, 10, action_block=2, block_keys=("a",), device=device)
    for t in range(4):  # L=4, S=2: strided positions 1 and 3; position 0 is not strided
        buf.append({"x": np.array([t]), "a": np.array([[t]], np.float32)})
    out = buf.get(3)
    assert out["x"].tolist() == [[1, 1, 3]]
    assert out["a"].tolist() == [[[0, 0], [2, 3]]]  # zero block, then entries 2..3


def test_full_history_once_lived_long_enough(backend, device):
    buf, model = make(max_len=9, ab=2, device=device)
    steps(buf, model, 12, 3)
    out = buf.get(4)
    assert out["pixels"][0, :, 0, 0].tolist() == [5, 7, 9, 11]
    assert out["action"][0, :, ::2].tolist() == [[6, 7], [8, 9], [10, 11]]
    assert_gets_equal(out, model.get(4))


def test_block_keys_omitted_when_n_is_one(backend, device):
    buf, model = make(device=device)
    steps(buf, model, 3, 3)
    assert list(buf.get(1)) == ["pixels"]


def test_block_nan_zeroed_and_inf_clamped(backend, device):
    buf = HistoryBuffer(1, 5, action_block=1, block_keys=("a",), device=device)
    for v in [np.nan, np.inf, -np.inf, np.nan]:
        buf.append({"a": np.array([[v]], np.float32)})
    big = torch.finfo(torch.float32).max
    assert buf.get(4)["a"].tolist() == [[[big], [-big], [0.0]]]


def test_block_keys_zero_padded_during_warm_up(backend, device):
    buf, model = make(max_len=20, ab=3, device=device)
    steps(buf, model, 4, 3)  # L=4, S=2
    out = buf.get(4)
    assert out["action"].shape == (3, 3, 6)
    assert (out["action"][:, :2] == 0).all()
    assert_gets_equal(out, model.get(4))


def test_small_max_len_pads_forever(backend, device):
    buf, model = make(max_len=3, ab=2, device=device)
    steps(buf, model, 30, 3)
    out = buf.get(4)  # needs (4-1)*2+1 = 7 entries, only 3 are ever held: S = 2
    assert out["pixels"][0, :, 0, 0].tolist() == [27, 27, 27, 29]
    assert_gets_equal(out, model.get(4))


def test_outputs_are_fresh_tensors_in_first_append_key_order(backend, device):
    buf, model = make(device=device)
    steps(buf, model, 3, 3)
    a, b = buf.get(2), buf.get(2)
    assert list(a) == ["pixels", "action"]
    a["pixels"].fill_(200)
    assert not torch.equal(a["pixels"], b["pixels"])
    assert_gets_equal(buf.get(2), model.get(2))


def test_get_into_out(backend, device):
    buf, model = make(device=device)
    steps(buf, model, 5, 3)
    out = {"pixels": torch.empty((2, 3, 2, 3), dtype=torch.uint8, device=device),
           "action": torch.empty((2, 2, 4), dtype=torch.float32, device=device)}
    res = buf.get(3, env_ids=[1, 2], out=out)
    assert res["pixels"] is out["pixels"] and res["action"] is out["action"]
    assert_gets_equal(res, model.get(3, [1, 2]))


def test_get_into_bad_out_raises(device):
    buf, model = make(device=device)
    steps(buf, model, 5, 3)
    good = {"pixels": torch.empty((3, 3, 2, 3), dtype=torch.uint8, device=device),
            "action": torch.empty((3, 2, 4), dtype=torch.float32, device=device)}
    with pytest.raises(ValueError, match=r"out\['action'\]: expected a tensor of shape \(3, 2, 4\), got NoneType"):
        buf.get(3, out={"pixels": good["pixels"]})
    with pytest.raises(ValueError, match=r"out\['pixels'\]: expected a contiguous torch.uint8 tensor of shape"):
        buf.get(3, out={**good, "pixels": good["pixels"].float()})


@pytest.mark.parametrize("bad", [2.0, "3", None, True])
def test_get_n_must_be_int(bad):
    buf = HistoryBuffer(2, 3, device="cpu")
    buf.append({"x": np.zeros(2)})
    with pytest.raises(TypeError, match="n: expected an int"):
        buf.get(bad)


# ------------------------------------------------------------------ num_strided, reset, len, state


def test_num_strided(backend, device):
    buf, model = make(max_len=6, ab=2, device=device)
    assert buf.num_strided() == [0, 0, 0]
    steps(buf, model, 4, 3)
    steps(buf, model, 1, 3, start=4, env_ids=[1])
    assert buf.num_strided() == [2, 3, 2] == model.num_strided()
    assert buf.num_strided([1, -1]) == [3, 2]


def test_reset_subsets_all_and_empty(backend, device):
    buf, model = make(device=device)
    steps(buf, model, 4, 3)
    buf.reset([])
    assert buf.num_strided() == [2, 2, 2]
    buf.reset([1])
    model.reset([1])
    assert buf.num_strided() == [2, 0, 2] and len(buf) == 0
    steps(buf, model, 2, 3, start=10)
    assert_gets_equal(buf.get(3), model.get(3))
    buf.reset()
    assert buf.num_strided() == [0, 0, 0] and buf.get(1) is None


def test_state_dict_round_trip(backend, device):
    buf, model = make(device=device)
    steps(buf, model, 9, 3)
    state = buf.state_dict()
    other = HistoryBuffer(3, 7, 2, ("action",), device=device)
    other.load_state_dict(state)
    assert_gets_equal(other.get(3), model.get(3))
    steps(buf, model, 1, 3, start=9)
    assert other.get(1)["pixels"][0, 0, 0, 0] == 8  # the snapshot did not follow later appends
    with pytest.raises(ValueError, match="state_dict: max_len is 7, this buffer has 8"):
        HistoryBuffer(3, 8, 2, ("action",), device=device).load_state_dict(state)


@pytest.mark.cuda
def test_state_dict_across_devices():
    buf, model = make(device="cuda")
    steps(buf, model, 5, 3)
    cpu = HistoryBuffer(3, 7, 2, ("action",), device="cpu")
    cpu.load_state_dict(buf.state_dict())
    back = HistoryBuffer(3, 7, 2, ("action",), device="cuda")
    back.load_state_dict(cpu.state_dict())
    assert_gets_equal(back.get(3), model.get(3))


def test_nbytes_and_allocation_failure_names_bytes_and_device():
    buf = HistoryBuffer(3, 7, device="cpu")
    buf.append({"x": np.zeros((3, 1, 5), np.float32)})
    assert buf.nbytes == 3 * 7 * 5 * 4
    huge = HistoryBuffer(1 << 20, 1 << 20, device="cpu")
    with pytest.raises(MemoryError, match=rf"cannot allocate {(1 << 40) * 8} bytes of storage on cpu"):
        huge.append({"x": np.zeros(1 << 20)})
    assert huge.keys == ()


def test_get_fetches_only_the_keys_asked_for(backend, device):
    buf, _ = make(device=device)
    for t in range(5):
        buf.append({"pixels": np.full((3, 1, 2), t, np.float32), "action": np.full((3, 1, 1), t, np.float32),
                    "reward": np.full(3, t, np.float32)})
    full = buf.get(3)
    only = buf.get(3, keys=("pixels",))
    assert list(only) == ["pixels"] and torch.equal(only["pixels"], full["pixels"])
    two = buf.get(3, [2, 0], keys=["reward", "action"])
    assert set(two) == {"reward", "action"}
    assert torch.equal(two["action"], full["action"][[2, 0]]) and torch.equal(two["reward"], full["reward"][[2, 0]])
    assert buf.get(1, keys=("action",)) == {}  # block keys are omitted when n == 1, as without keys
    out = {"pixels": torch.empty_like(only["pixels"])}
    assert buf.get(3, out=out, keys=("pixels",))["pixels"] is out["pixels"]  # out needs only the keys asked for
    before = snapshot(buf)
    with pytest.raises(ValueError, match=r"keys: \['nope'\] are not stored; the keys are \['pixels', 'action', "):
        buf.get(3, keys=("pixels", "nope"))
    with pytest.raises(TypeError, match="keys: expected an iterable of key names"):
        buf.get(3, keys="pixels")
    assert_unchanged(buf, before)
