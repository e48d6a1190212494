"""The action codec of a source: the fill of rows whose action the env ignored, and the actions a caller sends.

:func:`action_fill` and :func:`check_action_fill` decide what such a row stores (in the action dtype) and echoes
(float32, in the history); :class:`ActionCodec` turns the actions a caller sends into the ``(R, *shape)`` host array the
env executes (checked, clipped to a ``Box``) and its float32 echo ``(R, A)``."""

import numpy as np
import torch

from gpubuf._core.inputs import as_tensor, cast_keeps_values, cast_refusal, check_cast, lossless

# torch dtypes of actions that read as a numpy array without a copy (the steady state of ActionCodec.host)
_NUMPY_READABLE = (torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64,
                   torch.uint8)


def action_fill(dtype) -> float | int | bool:
    """The action stored on a row whose action the env ignored: NaN for float actions, -1 for signed integer actions
    (outside every ``Discrete`` space), the largest value for unsigned ones (False for bool)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "fc":
        return float("nan")
    if dtype.kind == "b":
        return False
    return -1 if dtype.kind == "i" else int(np.iinfo(dtype).max)


def check_action_space(space, name: str = "env") -> None:
    """``TypeError`` naming ``name`` unless ``space`` is one a source encodes: ``Discrete`` from 0, or a float ``Box``
    (clipped to its bounds)."""
    kind = type(space).__name__
    dtype = getattr(space, "dtype", None)
    ok = (kind == "Discrete" and int(getattr(space, "start", 0)) == 0) or (
        kind == "Box" and dtype is not None and np.dtype(dtype).kind == "f")
    if not ok:
        raise TypeError(f"{name}: expected an action space Discrete(n) (from 0) or a float Box, got {space} (other "
                        "spaces are not encoded yet: map actions to one of these with a gymnasium action wrapper)")


def _real_number(value, name: str) -> float:
    """``value`` as a Python float when it is a real number (not a bool), else ``TypeError``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a real number, got {value!r}")
    return float(value)


def echo_fill(value) -> float:
    """The float32 action echo's fill, checked: a real number float32 holds (NaN and inf too)."""
    v = _real_number(value, "action_fill")
    if np.isfinite(v) and abs(v) > float(np.finfo(np.float32).max):
        raise ValueError(f"action_fill: {value!r} does not fit the float32 action echo")
    return v


def check_action_fill(value, dtype) -> tuple:
    """``(stored fill, echo fill)`` of an ``action_fill`` argument for actions of numpy ``dtype``.

    ``None``: :func:`action_fill` stored and NaN echoed (the defaults). A value is stored as the action of every row
    whose action the env ignored and echoed (as float32) in the history; it must fit ``dtype`` exactly (an integer
    within the range of an integer dtype, 0/1 for bool, a real number a float dtype holds without rounding, NaN and inf
    included) and the float32 echo (integers up to ``2**24`` in magnitude), else ``ValueError`` naming ``action_fill``;
    a value that is not a real number is a ``TypeError``."""
    dtype = np.dtype(dtype)
    if value is None:
        return action_fill(dtype), float("nan")
    if dtype.kind == "b" and isinstance(value, (bool, np.bool_)):
        return bool(value), float(value)
    v = _real_number(value, "action_fill")
    why = None
    if dtype.kind == "f":
        if np.isfinite(v) and abs(v) > float(np.finfo(dtype).max):
            why = f"a {dtype} action cannot hold it"
        elif np.isfinite(v) and float(dtype.type(v)) != v:
            why = f"a {dtype} action holds it only rounded (to {float(dtype.type(v))!r})"
    elif not np.isfinite(v) or v != int(v):
        why = f"{dtype} actions are integers"
    else:
        lo, hi = (0, 1) if dtype.kind == "b" else (int(np.iinfo(dtype).min), int(np.iinfo(dtype).max))
        if not lo <= int(value) <= hi:
            why = f"{dtype} actions lie in [{lo}, {hi}]"
        elif abs(int(value)) > 2**24:
            why = "the float32 action echo holds integers up to 2**24 exactly"
    if why is None and dtype.kind == "f":
        try:
            echo = echo_fill(v)
        except ValueError:
            why = "the float32 action echo cannot hold it"
    if why is not None:
        raise ValueError(f"action_fill: {value!r} does not fit the actions ({why})")
    if dtype.kind == "f":
        return float(np.asarray(v, dtype)), echo
    return (bool(v) if dtype.kind == "b" else int(value)), float(int(value))


class ActionCodec:
    """The actions of one action space: what a caller may send, what the env executes, what the history echoes.

    Args:
        space: a gymnasium-style action space (``dtype``, ``shape``; ``n`` for ``Discrete``, ``low``/``high`` for
            ``Box``).
        n_envs: the most rows one call may carry.
        fill: the ``action_fill`` argument (:func:`check_action_fill`).

    Attributes: ``dtype`` (numpy) and ``shape`` of one env's action, ``n`` (``Discrete``; else ``None``), ``fill`` (the
    stored fill) and ``echo_fill`` (its float32 echo)."""

    def __init__(self, space, n_envs: int, fill=None):
        self.dtype = np.dtype(space.dtype)
        self.shape = tuple(getattr(space, "shape", None) or ())  # Discrete -> ()
        self.fill, self.echo_fill = check_action_fill(fill, self.dtype)
        self.n = getattr(space, "n", None)  # Discrete spaces: actions lie in [0, n)
        self._bounds = None  # continuous spaces: (low, high) per action dim, what EnvPool clips to
        if self.dtype.kind == "f" and hasattr(space, "low"):
            self._bounds = tuple(np.broadcast_to(bound, self.shape).astype(self.dtype)
                                 for bound in (space.low, space.high))
        self._torch_dtype = torch.from_numpy(np.zeros(0, self.dtype)).dtype
        self._sig = None  # the last accepted actions' (type, dtype, shape, lossless) (see _fast)
        self._buf = np.zeros((n_envs, *self.shape), dtype=self.dtype)
        self._on_devices = {}  # device -> the box's bounds there (device_checked)

    def zeros(self, lead: tuple) -> np.ndarray:
        """``(*lead, *shape)`` zero actions."""
        return np.zeros((*lead, *self.shape), dtype=self.dtype)

    def filled(self, n: int) -> np.ndarray:
        """``(n, *shape)`` actions, each the fill."""
        return np.full((n, *self.shape), self.fill, dtype=self.dtype)

    def fill_where(self, ignored: np.ndarray, actions: np.ndarray) -> np.ndarray:
        """``actions (R, *shape)`` with the fill on the ``ignored (R,)`` rows."""
        return np.where(ignored.reshape(-1, *[1] * len(self.shape)), np.asarray(self.fill, self.dtype), actions)

    @staticmethod
    def echo(actions: np.ndarray) -> np.ndarray:
        """The float32 echo ``(R, A)`` of executed ``actions (R, *shape)``: a fresh copy (``actions`` may be reused)."""
        return actions.reshape(len(actions), -1).astype(np.float32)

    def host(self, actions, R: int) -> np.ndarray:
        """``actions`` as the ``(R, *shape)`` host array to send (clipped for a ``Box``), checked. The returned array
        may be reused by the next call."""
        sig = self._sig
        if (sig is not None and type(actions) is sig[0] and actions.dtype == sig[1]
                and actions.shape == sig[2] and sig[2][0] == R):
            arr = self._fast(actions, R, sig[3])
            if arr is not None:
                return arr
        arr = self._checked(actions, R)
        self._sig = self._signature(actions)
        return arr

    def _signature(self, actions):
        """The steady-state signature of accepted ``actions``: numpy arrays, and CPU tensors that read as one (``None``
        for anything else: the checked path every time)."""
        if type(actions) is torch.Tensor:
            if actions.device.type != "cpu" or actions.dtype not in _NUMPY_READABLE:
                return None
            dtype = torch.empty(0, dtype=actions.dtype).numpy().dtype
        elif type(actions) is np.ndarray and actions.dtype.isnative:
            dtype = actions.dtype
        else:
            return None
        if dtype.kind != self.dtype.kind and not (self.dtype.kind == "u" and dtype.kind == "i"):
            return None  # float actions for a discrete env: checked path (integrality)
        ok = lossless(torch.from_numpy(np.zeros(0, dtype)).dtype, self._torch_dtype)
        return type(actions), actions.dtype, tuple(actions.shape), ok

    def _fast(self, actions, R: int, is_lossless: bool) -> np.ndarray | None:
        """The steady state: actions of the last accepted type, dtype and shape. ``None`` to take the checked path (a
        bad value: it raises there, with its message)."""
        if type(actions) is torch.Tensor:
            if actions.device.type != "cpu":
                return None
            try:
                arr = actions.detach().numpy()
            except RuntimeError:  # a lazy negation: the checked path resolves it
                return None
        else:
            arr = actions
        want = self._buf[:R] if R != len(self._buf) else self._buf
        if self.dtype.kind == "f":
            if np.count_nonzero(np.isfinite(arr)) != arr.size:
                return None
            if not is_lossless:
                try:
                    check_cast(torch.from_numpy(np.ascontiguousarray(arr)), self._torch_dtype, "actions")
                except (TypeError, ValueError):
                    return None
            arr = arr.reshape(want.shape)
            if self._bounds is None:
                np.copyto(want, arr)
            else:  # np.clip, as ufuncs (the wrapper costs more than the work)
                np.minimum(arr, self._bounds[1], out=want)
                np.maximum(want, self._bounds[0], out=want)
            return want
        n = self.n
        if n is not None and arr.size and not (0 <= arr.min() and arr.max() < n):
            return None
        if not is_lossless and n is None:
            return None
        np.copyto(want, arr.reshape(want.shape), casting="unsafe")
        return want

    def _checked(self, actions, R: int) -> np.ndarray:
        """Every check, with the message of the first that fails; a fresh array."""
        if isinstance(actions, torch.Tensor):
            actions = actions.detach().cpu()  # envpool steps on the host: one read per step
            if actions.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
                actions = actions.float()  # dtypes numpy lacks, widened exactly
            actions = as_tensor(actions, "actions").resolve_conj().resolve_neg().numpy()
        arr = np.asarray(actions)
        want = (R, *self.shape)
        if arr.dtype.kind not in "biuf":
            raise TypeError(f"actions: expected numbers shaped {want}, got a {arr.dtype} array")
        if arr.ndim == 0 or arr.shape[0] != R or [d for d in arr.shape[1:] if d != 1] != [
                d for d in self.shape if d != 1]:
            raise ValueError(f"actions: expected shape {want}, got {arr.shape}")
        if self.dtype.kind == "f":  # a continuous env: finite values its dtype holds
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise ValueError(f"actions: expected finite actions, got {arr[~np.isfinite(arr)][:5].tolist()}")
            readable = arr if arr.flags.c_contiguous and arr.flags.writeable else arr.copy()  # a JAX array: read-only
            check_cast(torch.from_numpy(readable), self._torch_dtype, "actions")
            arr = arr.reshape(want).astype(self.dtype)
            if self._bounds is not None:  # what the env executes (EnvPool clips to its box)
                arr = np.clip(arr, *self._bounds)
            return arr
        # a discrete env: integral actions only, never truncated silently
        if self.dtype.kind in "iu":
            if arr.dtype.kind == "f" and not np.array_equal(arr, np.trunc(arr)):
                bad = arr[~(arr == np.trunc(arr))][:5].tolist()
                raise ValueError(f"actions: a discrete env takes integer actions, got {bad}; map a continuous "
                                 "planner's output explicitly (e.g. (plan > 0).long() or plan.round())")
            n = self.n
            if n is not None and arr.size and not (0 <= arr.min() and arr.max() < n):
                raise ValueError(f"actions: expected actions in [0, {self.n}), got [{arr.min()}, {arr.max()}]")
        return arr.reshape(want).astype(self.dtype, copy=False)

    def device_checked(self, actions: torch.Tensor, R: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(actions (R, *shape) in the space's dtype, clipped for a Box; () bool)`` of device ``actions``, the checks
        of :meth:`host` that read values run on the device (the bool: whether they pass); those that need no values
        raise here, as there."""
        want, dims = (R, *self.shape), [d for d in self.shape if d != 1]
        if not isinstance(actions, torch.Tensor) or actions.is_complex() or actions.dim() == 0 \
                or actions.layout != torch.strided or actions.shape[0] != R \
                or [d for d in actions.shape[1:] if d != 1] != dims:
            got = tuple(actions.shape) if isinstance(actions, torch.Tensor) else type(actions).__name__
            raise ValueError(f"actions: expected a dense real tensor shaped {want}, got {got}")
        a = actions.detach().reshape(want)
        if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # widened exactly (few ops take them)
            a = a.to(torch.float32)
        if self.dtype.kind == "f":  # finite values the space's dtype holds, clipped to the box
            why = cast_refusal(a.dtype, self._torch_dtype)
            if why:
                raise TypeError(f"actions: cannot send {a.dtype} as {self._torch_dtype} ({why})")
            ok = torch.isfinite(a).all() if a.is_floating_point() else torch.ones((), dtype=torch.bool, device=a.device)
            if not lossless(a.dtype, self._torch_dtype):
                ok = ok & cast_keeps_values(a, self._torch_dtype)
            a = a.to(self._torch_dtype)
            if self._bounds is not None:
                low, high = self._device_bounds(a.device)
                a = torch.minimum(torch.maximum(a, low), high)
            return a, ok
        ok = torch.ones((), dtype=torch.bool, device=a.device)
        if a.is_floating_point():  # integral values only
            ok = (a == torch.trunc(a)).all()
        wide = a
        if a.dtype in (torch.uint16, torch.uint32, torch.uint64):  # compared as int64 (few ops take them)
            wide = a.view(torch.int64) if a.dtype == torch.uint64 else a.to(torch.int64)  # from 2**63: negative
        if self.n is not None:
            ok = ok & ((wide >= 0) & (wide < self.n)).all()
        return a.to(self._torch_dtype), ok

    def _device_bounds(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The box's ``(low, high)`` on ``device``, copied there once."""
        if device not in self._on_devices:
            self._on_devices[device] = tuple(torch.from_numpy(b).to(device) for b in self._bounds)
        return self._on_devices[device]
