"""Running and evaluating converted models: the runner, evaluation, plots, ``doctor``."""
