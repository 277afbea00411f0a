"""The paper's published numbers (Nair & Saini 2026, §5), for the report's side-by-side columns.

Latencies in seconds, rates and shares in percent, exactly as printed in Tables 1–3.
"""

from __future__ import annotations

# Table 1: mean latency, routed vs no-route, by Δcomm (uniform) and skewed at 2 ms.
TABLE1: dict[str, tuple[float, float]] = {
    "2ms": (0.310, 0.323),
    "200ms": (0.785, 0.323),
    "1s": (2.271, 0.323),
    "skewed 2ms": (0.206, 0.266),
}

# Table 2: (expected hit %, actual hit %, latency s) at Δcomm 2 ms, Δpoll 500 ms.
TABLE2: dict[tuple[str, str], tuple[float, float, float]] = {
    ("uniform", "none"): (47.3, 83.1, 0.323),
    ("uniform", "paper"): (66.4, 83.7, 0.310),
    ("skewed", "none"): (67.4, 85.6, 0.266),
    ("skewed", "paper"): (88.6, 91.4, 0.206),
}

# Table 3: hotspot share (%) — busiest node's share of requests.
TABLE3: dict[str, float] = {
    "uniform none": 28.7,
    "skewed none": 34.7,
    "comm 1s": 64.9,
    "comm 200ms": 67.4,
    "comm 2ms": 70.0,
    "poll 20ms": 74.8,
    "poll 100ms": 75.7,
    "poll 2s": 66.9,
    "poll 300s": 42.2,
    "skewed 2ms": 88.1,
}

# The targets for `cost` (ratios of mean latency to `none`).
TARGET_RATIO = {"2ms": 0.90, "skewed 2ms": 0.65, "200ms": 1.00, "1s": 1.00}
TARGET_PRESSURE_RATIO = 0.60
TARGET_HOTSPOT = 0.35
TARGET_ORACLE_GAIN = 0.90
PAPER_ACTUAL_HIT_UNIFORM = 0.837
