"""Every input HistoryBuffer rejects raises an error whose message names the argument, and leaves
the buffer's state exactly as it was (nothing is written)."""

import numpy as np
import pytest
import torch
from snapshots import assert_unchanged, snapshot

from gpubuf import HistoryBuffer


def filled(device):
    buf = HistoryBuffer(3, 4, 2, ("action",), device=device)
    for t in range(3):
        buf.append({"pixels": np.full((3, 1, 2), t, np.uint8), "action": np.full((3, 1, 2), t, np.float32)})
    return buf


def good(rows=3):
    return {"pixels": np.ones((rows, 1, 2), np.uint8), "action": np.ones((rows, 1, 2), np.float32)}


CASES = {
    "info not a dict": (lambda b: b.append([1, 2, 3]), TypeError, "info_dict: expected a non-empty dict"),
    "empty info": (lambda b: b.append({}), TypeError, "info_dict: expected a non-empty dict"),
    "non-str key": (lambda b: b.append({**good(), 3: np.ones(3)}), TypeError, "info_dict: keys must be str"),
    "wrong row count": (lambda b: b.append({**good(), "pixels": np.ones((2, 1, 2), np.uint8)}), ValueError,
                        r"pixels: expected a leading env dim of 3 rows, got shape \(2, 1, 2\)"),
    "rows vs env_ids": (lambda b: b.append(good(3), env_ids=[0, 1]), ValueError,
                        "pixels: expected a leading env dim of 2 rows"),
    "env id out of range": (lambda b: b.append(good(2), env_ids=[0, 3]), IndexError,
                            r"env_ids: ids must lie in \[-3, 3\), got \[3\]"),
    "float env ids": (lambda b: b.append(good(2), env_ids=[0.0, 1.0]), TypeError,
                      "env_ids: expected a 1-D sequence of ints"),
    "string value": (lambda b: b.append({**good(), "action": "left"}), TypeError, "action: expected a torch tensor"),
    "list value": (lambda b: b.append({**good(), "action": [1, 2, 3]}), TypeError, "action: expected a torch tensor"),
    "scalar for shaped key": (lambda b: b.append({**good(), "action": 1.0}), ValueError,
                              r"action: a scalar cannot fill per-env shape \(1, 2\)"),
    "missing key": (lambda b: b.append({"pixels": good()["pixels"]}), ValueError, r"missing \['action'\]"),
    "extra key": (lambda b: b.append({**good(), "r": np.ones(3)}), ValueError, r"unexpected \['r'\]"),
    "changed shape": (lambda b: b.append({**good(), "action": np.ones((3, 1, 3), np.float32)}), ValueError,
                      r"action: expected per-env shape \(1, 2\), got \(1, 3\)"),
    "unsafe dtype": (lambda b: b.append({**good(), "pixels": np.ones((3, 1, 2), np.float64)}), TypeError,
                     "pixels: cannot store torch.float64 in the stored dtype torch.uint8"),
    "reset out of range": (lambda b: b.reset([5]), IndexError, "env_ids: ids must lie in"),
    "get ids 2-D": (lambda b: b.get(2, env_ids=[[0, 1]]), TypeError, "env_ids: expected a 1-D sequence of ints"),
    "get bad n": (lambda b: b.get(2.5), TypeError, "n: expected an int, got 2.5"),
    "get bad out": (lambda b: b.get(2, out={"pixels": torch.empty(3)}), ValueError, r"out\['pixels'\]: expected"),
    "num_strided bad ids": (lambda b: b.num_strided([7]), IndexError, "env_ids: ids must lie in"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rejected_input_leaves_buffer_unchanged(case, backend, device):
    call, exc, message = CASES[case]
    buf = filled(device)
    before = snapshot(buf)
    with pytest.raises(exc, match=message):
        call(buf)
    assert_unchanged(buf, before)
