"""Layer 7, where config meets code: ``train`` builds and fits a run from its Hydra config, ``facts`` derives
the run's facts (world size, micro-batch, mesh) once each, ``config_values`` checks every value once per launch,
``memory_check`` refuses a run that cannot fit, ``child`` is what the launcher starts on ranks 1..N-1."""
