"""The pipeline's plumbing: dvc.yaml rendering, sealed blocks, code manifests, dvc.lock reads, run status,
the stage server and multi-process chunking."""
