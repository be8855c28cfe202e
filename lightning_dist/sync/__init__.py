"""The sync parts, without Lightning: how and when replicas agree (``diloco``: DiLoCo's inner/outer loop)."""
