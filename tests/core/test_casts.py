"""Only value-preserving casts: lossless ones pass, narrowing host inputs are checked on their values,
float -> int and unchecked device narrowing raise ``TypeError`` naming the key. Nothing is written on error."""

import numpy as np
import pytest
import torch
from snapshots import assert_unchanged, snapshot

from gpubuf import HistoryBuffer, Transition, TransitionBuffer
from gpubuf._core.inputs import check_cast, lossless


def history(dtype, device="cpu"):
    buf = HistoryBuffer(2, 3, device=device)
    buf.append({"x": torch.zeros(2, 1, dtype=dtype)})
    return buf


@pytest.mark.parametrize("src, dst", [(torch.int64, torch.uint8), (torch.int32, torch.int8),
                                      (torch.int64, torch.bool), (torch.int64, torch.float32)])
def test_int_overflow_raises_and_fitting_values_pass(src, dst, backend, device):
    buf = history(dst, device)
    before = snapshot(buf)
    hi = {torch.uint8: 300, torch.int8: 128, torch.bool: 2, torch.float32: 2**24 + 1}[dst]
    with pytest.raises(TypeError, match=rf"x: cannot store {src} in the stored dtype {dst} without changing values"):
        buf.append({"x": torch.tensor([[1], [hi]], dtype=src)})
    assert_unchanged(buf, before)
    buf.append({"x": torch.tensor([[1], [0]], dtype=src)})  # checked: fits
    assert buf.get(1)["x"].tolist() == [[1], [0]] or buf.get(1)["x"].tolist() == [[True], [False]]


def test_float_narrowing_overflow_raises_rounding_passes(backend, device):
    buf = history(torch.float32, device)
    before = snapshot(buf)
    with pytest.raises(TypeError, match=r"x: cannot store torch.float64 .* \(a finite value exceeds the largest"):
        buf.append({"x": np.array([[0.5], [1e300]])})
    assert_unchanged(buf, before)
    buf.append({"x": np.array([[0.1], [np.inf]])})  # rounding and inf -> inf keep the values' meaning
    assert buf.get(1)["x"][:, 0].tolist() == [np.float32(0.1), np.inf]


def test_float_into_int_always_raises(backend, device):
    buf = history(torch.int32, device)
    with pytest.raises(TypeError, match=r"x: cannot store torch.float32 .* \(float into an integer dtype\)"):
        buf.append({"x": torch.tensor([[1.0], [2.0]])})


def test_python_scalars_are_checked():
    buf = HistoryBuffer(2, 3, device="cpu")
    buf.append({"x": np.zeros(2, np.uint8)})
    buf.append({"x": 7})
    with pytest.raises(TypeError, match="x: cannot store torch.int64 in the stored dtype torch.uint8"):
        buf.append({"x": 300})
    assert buf.get(2)["x"].tolist() == [[0, 7], [0, 7]]


def test_big_endian_numpy_is_read_by_value():
    buf = HistoryBuffer(2, 3, device="cpu")
    buf.append({"x": np.array([[1.5], [-2.0]], dtype=">f4")})
    buf.append({"x": np.array([[3], [4]], dtype=">i2")})  # int16 -> float32: lossless
    assert buf.get(2)["x"].tolist() == [[1.5, 3.0], [-2.0, 4.0]]


def test_replay_insert_checks_values_too(device):
    def tr(reward):
        return Transition(observation=np.zeros((1, 2, 3), np.uint8), action=np.zeros((1, 2), np.int64),
                          reward=reward, terminated=np.zeros((1, 2), bool), truncated=np.zeros((1, 2), bool))
    buf = TransitionBuffer(8, 2, tr(np.zeros((1, 2), np.float32)), device=device)
    before = snapshot(buf)
    with pytest.raises(TypeError, match="reward: cannot store torch.float64 .* exceeds the largest torch.float32"):
        buf.insert(tr(np.array([[1.0, 1e39]])))
    assert_unchanged(buf, before)
    buf.insert(tr(np.array([[0.25, -1.0]])))  # float64 rewards, as numpy makes them: rounded to float32
    assert len(buf) == 2


@pytest.mark.parametrize("src, dst, expected", [
    (torch.uint8, torch.int16, True), (torch.int16, torch.float32, True), (torch.int32, torch.float32, False),
    (torch.int32, torch.float64, True), (torch.float16, torch.bfloat16, False), (torch.bool, torch.float16, True),
    (torch.float32, torch.float64, True), (torch.float64, torch.float32, False), (torch.int8, torch.uint8, False),
])
def test_lossless_table(src, dst, expected):
    assert lossless(src, dst) is expected


def test_device_narrowing_is_not_checked_but_rejected():
    t = torch.zeros(3, dtype=torch.float64, device="meta")  # any non-host tensor: checking would read it
    with pytest.raises(TypeError, match=r"narrowing cast of a meta tensor is not checked .* \.to\(torch.float32\)"):
        check_cast(t, torch.float32, "x")


def test_python_floats_keep_their_value_and_their_default_dtype():
    buf = HistoryBuffer(2, 3, device="cpu")
    buf.append({"x": 0.1, "y": np.zeros(2, np.float64)})
    assert buf.get(1)["x"].dtype == torch.get_default_dtype()  # a new key from a Python float, as torch.tensor(0.1)
    buf.append({"x": 0.25, "y": 0.1})
    assert buf.get(1)["y"][0, 0].item() == 0.1  # exactly: the Python float is not rounded through float32 first
    before = snapshot(buf)
    with pytest.raises(TypeError, match=r"x: cannot store torch.float64 .* exceeds the largest torch.float32"):
        buf.append({"x": 1e300, "y": 0.0})
    with pytest.raises(TypeError, match="x: the integer 1180591620717411303424 does not fit int64"):
        buf.append({"x": 2**70, "y": 0.0})
    assert_unchanged(buf, before)
    with pytest.raises(TypeError, match=r"z: cannot store torch.float64 .* exceeds the largest torch.float32"):
        HistoryBuffer(2, 3, device="cpu").append({"z": 1e300})  # also when the key is new


@pytest.mark.parametrize("src, dst, good, bad", [
    (torch.uint32, torch.int16, [1, 7], [1, 70000]),
    (torch.uint64, torch.int64, [0, 2**62], [0, 2**63 + 5]),
    (torch.uint16, torch.uint8, [0, 255], [0, 256]),
    (torch.int64, torch.complex64, [3, -2**24], [3, 2**30 + 1]),
    (torch.complex128, torch.complex64, [1 + 2j, -3j], [1 + 2j, 1e300 + 0j]),
    (torch.float32, torch.float8_e4m3fn, [1.0, -448.0], [1.0, 500.0]),
    (torch.float64, torch.bfloat16, [1.0, 3e38], [1.0, 1e300]),
])
def test_unsigned_complex_and_float8_narrowing_is_checked_on_values(src, dst, good, bad):
    """Sources and targets that torch's own reductions do not cover are still checked by value."""
    def tensor(values):
        if src in (torch.uint16, torch.uint32, torch.uint64):
            return torch.from_numpy(np.array(values, dtype=str(src).removeprefix("torch.")))
        return torch.tensor(values, dtype=src if src.is_complex else torch.float64 if src.is_floating_point
                            else None).to(src)
    check_cast(tensor(good), dst, "x")
    with pytest.raises(TypeError, match=rf"x: cannot store {src} in the stored dtype {dst} without changing values"):
        check_cast(tensor(bad), dst, "x")


@pytest.mark.parametrize("src, dst, why", [(torch.complex64, torch.int32, "complex into an integer dtype"),
                                           (torch.complex64, torch.float64, "complex into a real dtype"),
                                           (torch.float8_e5m2, torch.int8, "float into an integer dtype")])
def test_kind_changes_are_rejected_with_the_right_reason(src, dst, why):
    with pytest.raises(TypeError, match=rf"x: .*\({why}\)"):
        check_cast(torch.ones(2).to(src), dst, "x")


def test_float8_and_half_types_widen_without_a_value_check():
    assert lossless(torch.float8_e4m3fn, torch.float16) and lossless(torch.float8_e5m2, torch.float16)
    assert lossless(torch.bfloat16, torch.float32) and lossless(torch.complex32, torch.complex64)
    assert not lossless(torch.float16, torch.bfloat16) and not lossless(torch.bfloat16, torch.float16)
    assert lossless(torch.int16, torch.complex64) and not lossless(torch.int64, torch.complex64)


def test_inf_into_float8_e4m3fn_which_has_no_infinity_is_rejected():
    check_cast(torch.tensor([1.0, -448.0, float("nan")]), torch.float8_e4m3fn, "x")  # NaN it has
    with pytest.raises(TypeError, match=r"x: .* \(torch.float8_e4m3fn has no infinity \(it would store 448\)\)"):
        check_cast(torch.tensor([1.0, float("inf")]), torch.float8_e4m3fn, "x")


DOORS = [(np.int64, np.array([1.7, 0.0])), (np.int64, np.array([np.nan, 0.0])), (np.uint8, np.array([300, 0])),
         (np.uint8, np.array([-1, 0])), (np.bool_, np.array([2, 0])), (np.float32, np.array([1e300, 0.0])),
         (np.int64, np.array([7, 0], np.int32)), (np.uint8, np.array([200, 0])), (np.float32, np.array([0.1, 0.0])),
         (np.bool_, np.array([1, 0])), (np.float64, np.array([3, 0], np.int16))]


@pytest.mark.parametrize(("stored", "values"), DOORS,
                         ids=lambda x: str(x.tolist()) if isinstance(x, np.ndarray) else None)
def test_every_door_casts_by_the_one_rule(stored, values, tmp_path):
    """One rule (``check_cast``) decides at every door that stores values in a fixed dtype: a history key, a
    ``TensorSource`` info field and each ``gpubuf.torchrl.ReplayStorage`` tier accept exactly the values it accepts
    (``VectorEnvSource``'s info fields: tests/sources/test_tensor_source.py)."""
    from extras import needs

    gym = needs("gymnasium")
    needs("torchrl")
    from tensordict import TensorDict
    from torchrl.data import ReplayBuffer

    from gpubuf.sources.tensors import TensorSource
    from gpubuf.torchrl import ReplayStorage

    try:
        check_cast(torch.from_numpy(values), torch.from_numpy(np.zeros(0, stored)).dtype, "x")
        expected = True
    except TypeError:
        expected = False

    def accepted(call) -> bool:
        try:
            call()
            return True
        except (TypeError, ValueError) as err:
            assert "without changing values" in str(err), err
            return False

    hist = HistoryBuffer(2, 3, device="cpu")
    hist.append({"x": np.zeros(2, stored)})
    box = gym.spaces.Box(-1, 1, (1,), np.float32)
    src = TensorSource(2, box, box, final_obs=False, device="cpu", info_keys={"x": stored(0)})
    src.reset(np.zeros((2, 1), np.float32), infos={"x": np.zeros(2, stored)})
    no = np.zeros(2, bool)
    step = dict(actions=np.zeros((2, 1), np.float32), obs=np.zeros((2, 1), np.float32), reward=np.zeros(2),
                terminated=no, truncated=no)
    doors = {"history": lambda: hist.append({"x": values}),
             "TensorSource": lambda: src.step(**step, infos={"x": values})}
    for tier in ("memory", "dir"):
        storage = ReplayStorage(4, storage_dir=tmp_path / "d") if tier == "dir" else ReplayStorage(4)
        rb = ReplayBuffer(storage=storage, batch_size=2)
        rb.extend(TensorDict({"x": torch.from_numpy(np.zeros(2, stored))}, [2]))
        doors[f"ReplayStorage {tier}"] = lambda rb=rb: rb.extend(TensorDict({"x": torch.from_numpy(values)}, [2]))
    assert {name: accepted(call) for name, call in doors.items()} == dict.fromkeys(doors, expected)
