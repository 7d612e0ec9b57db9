"""Running and evaluating converted models: sessions, the runner, evaluation, plots."""
