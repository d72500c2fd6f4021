"""``pdstack bench``: a prefix-heavy chat benchmark (asked vs served load, TTFT)."""
