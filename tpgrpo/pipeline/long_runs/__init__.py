"""Long runs: finished blocks of iterations sealed into their own pipeline files (``blocks``, ``sealing``), their
logs' digests (``block_logs``), the stat cache that vouches for sealed blocks (``seal_cache``), retention of old
outputs (``retention``).
Reached through :mod:`tpgrpo.pipeline.long_run`, so a short run imports none of it."""
