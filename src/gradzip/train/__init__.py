"""Training utilities: models, data loading, and learning-rate schedules."""
