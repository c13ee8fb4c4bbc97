"""What every probe method shares: the failure policy (``guarded_probe``) and host arrays."""

from __future__ import annotations

import functools

import numpy as np

_INT64 = np.dtype(np.int64)


def as_int64(values) -> np.ndarray:
    """A 1-D int64 numpy array of a torch tensor, numpy array or sequence (host side);
    a view when the values already are int64 on the host (callers never write to it)."""
    if type(values) is np.ndarray and values.dtype == _INT64 and values.ndim == 1:  # (the usual: already one)
        return values
    if getattr(values, "is_cpu", False) and not values.requires_grad:
        values = values.numpy()  # a CPU tensor: a view, without detach/to (~2 µs per call on the hot path)
    elif hasattr(values, "detach"):  # torch.Tensor, without importing torch here
        values = values.detach().to("cpu").numpy()
    a = np.asarray(values, dtype=np.int64)
    return a if a.ndim == 1 else a.reshape(-1)


_SAME_COUNTS: dict[tuple[int, int], np.ndarray] = {}


def same_counts(n: int, per: int) -> np.ndarray:
    """``n`` requests that each wrote ``per`` slots (int64, read-only), one array kept per shape:
    a decode batch asks for the same one every step, and ``Probes.forward`` knows it by identity
    (a new array and its checks cost ~3 µs a step)."""
    counts = _SAME_COUNTS.get((n, per))
    if counts is None:
        if len(_SAME_COUNTS) >= 64:
            _SAME_COUNTS.clear()
        counts = _SAME_COUNTS[(n, per)] = np.full(n, per, np.int64)
        counts.flags.writeable = False
    return counts


def is_ones(counts: np.ndarray, n: int) -> bool:
    """Whether ``counts`` are ``n`` ones: by identity for ``same_counts(n, 1)``, else checked."""
    return counts is _SAME_COUNTS.get((n, 1)) or bool((counts == 1).all())


def guarded_probe(method):
    """Run a probe; on any exception count it, report it once, disable that probe."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if not self.enabled:
            if self.no_ring_reason:
                self._dropped_for_want_of_a_ring()
            return None
        if name in self.disabled_probes:
            return None
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the engine must never see our failures
            self.disabled_probes.add(name)
            self.report_probe_error(name, exc)
            return None

    return wrapper
