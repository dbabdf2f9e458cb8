"""Backend workarounds: where a computation is written for the compiler rather than for the reader.

Each function here computes what its one-line definition says, in a form that a backend (XLA:CPU, as
measured on this project's machines) runs much faster or in less memory than the obvious form; each
docstring gives the measurement that justifies it and the command that re-measures it. Algorithm
modules call these instead of spelling the trick out in their math.
"""

from __future__ import annotations

# ------------------------------------------------------------------------------------------ PowerSGD

# ---------------------------------------------------------------------------------------------- DGC

# ----------------------------------------------------------------------- quantized, sign, 1-bit Adam
