"""The start of a script that measures a fresh interpreter's peak RSS: run in a subprocess, it imports carrack,
resets the kernel's high-water mark (where /proc/self/clear_refs allows) and records the baseline RSS; the caller's
script continues from there and reads `status("VmHWM")` for the peak."""

import textwrap

PEAK_RSS_PRELUDE = textwrap.dedent("""
    import json, sys
    import numpy as np
    import carrack

    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise KeyError(key)

    try:  # reset the high-water mark to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    baseline = status("VmRSS")
""")
