"""A failed CUDA graph capture: a path that syncs with the host falls back to eager steps with its frames
printed; a kernel fault (the CUDA context is lost) stops the engine with one clear error."""

from __future__ import annotations

import pytest

from morion.errors import MorionError
from morion.runner.capture_failure import is_device_fault
from morion.runner.capture_failure import report_capture_failure as _report_capture_failure


def _raised(message: str) -> RuntimeError:
    try:
        raise RuntimeError(message)
    except RuntimeError as error:
        return error


def test_a_host_sync_is_reported_with_its_frames_and_falls_back(capsys):
    error = _raised("operation not permitted when stream is capturing")
    assert not is_device_fault(error)
    _report_capture_failure("CUDA graph capture FAILED, decode runs eagerly", error)
    printed = capsys.readouterr().err
    assert "morion: CUDA graph capture FAILED, decode runs eagerly: operation not permitted" in printed
    assert "_raised" in printed  # the innermost frame


@pytest.mark.parametrize(
    "message",
    [
        "Triton Error [CUDA]: an illegal memory access was encountered",
        "CUDA error: device-side assert triggered",
        "CUDA error: unspecified launch failure",
    ],
)
def test_a_device_fault_stops_the_engine(message, capsys):
    error = _raised(message)
    assert is_device_fault(error)
    with pytest.raises(MorionError, match="a kernel faulted during CUDA graph capture") as raised:
        _report_capture_failure("CUDA graph capture FAILED, decode runs eagerly", error)
    assert raised.value.__cause__ is error
    assert message in capsys.readouterr().err
