"""DVC's own files and tpgrpo's patches of DVC: atomic writes of dvc.yaml, dvc.lock and the rwlock
(``dvc_atomic``), a stage's lock write of its own block only (``lock_blocks``), DVC's and the project's locks
(``dvclock``) and the params a stage read, checked against what DVC records (``params_read``)."""
