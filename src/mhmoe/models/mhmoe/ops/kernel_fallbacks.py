"""Which kernels failed and were replaced by their PyTorch reference, and why.

A dispatch point that catches a kernel's failure and runs the reference instead (`routing.py`, when the kernels were
chosen automatically) calls `record_fallback(kernel, error)`: the first failure of each kernel is logged once at
WARNING with its reason, and `fallbacks()` returns {kernel: reason} for the benchmarks and the reproduction harness to
write into what they report. `reset_fallbacks()` forgets them (the dispatch points then try the kernels again).

Standard library only: exported checkpoints carry this file.
"""

import logging
import threading

logger = logging.getLogger(__name__)
_FALLBACKS: dict[str, str] = {}
_LOCK = threading.Lock()


def record_fallback(kernel: str, error: BaseException, note: str = "") -> bool:
    """Record that `kernel` failed with `error` and its reference ran instead; log it at WARNING the first time.
    Returns whether this was the kernel's first recorded failure."""
    reason = f"{type(error).__name__}: {error}"
    with _LOCK:
        first = kernel not in _FALLBACKS
        if first:
            _FALLBACKS[kernel] = reason
    if first:
        logger.warning("the %s kernel failed (%s); its PyTorch reference runs instead%s", kernel, reason, note)
    return first


def fallbacks() -> dict[str, str]:
    """{kernel: reason of its first failure} for every kernel replaced by its reference since the last reset."""
    with _LOCK:
        return dict(_FALLBACKS)


def reset_fallbacks() -> None:
    """Forget recorded failures (tests; a harness between runs)."""
    with _LOCK:
        _FALLBACKS.clear()
