"""Artifacts on disk and their schemas: Zarr trajectories, Parquet tables, embeddings, atomic writes."""
