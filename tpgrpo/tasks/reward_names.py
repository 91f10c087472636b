"""The names the reward registry (:mod:`tpgrpo.tasks.rewards`) knows, without the registry.

Why a module of its own: params validation (:mod:`tpgrpo.config_values`) checks reward names, and every stage
loads its params through it. Importing the registry there put the registry, the task code and every model
reward (the registry names their modules) into every stage's code manifest, so an edit to a reward re-ran
credit, which scores nothing. The registry refuses to import when its names differ from these.
"""

REWARD_NAMES: tuple[str, ...] = ("geneval", "geneval_soft", "ocr", "jpeg_compressibility", "pickscore",
                                 "geneval_detector", "geneval_detector_soft", "aesthetic", "remote")
