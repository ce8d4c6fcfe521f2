from __future__ import annotations

import numpy as np


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"p50": None, "p95": None, "n": 0}
    return {
        "p50": round(float(np.percentile(values, 50)), 1),
        "p95": round(float(np.percentile(values, 95)), 1),
        "n": len(values),
    }
