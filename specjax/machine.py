"""The machine a result was measured on, as benchmark reports record it."""
from __future__ import annotations

from typing import Optional


def cpu_model() -> Optional[str]:
    """The CPU's model name from ``/proc/cpuinfo`` (e.g. ``"Intel(R) Xeon(R) Processor"``), or
    None where the file is missing or names none (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
