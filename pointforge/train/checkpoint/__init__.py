"""A run's checkpoints: :mod:`.format` (the file: atomic save, device-agnostic load, wrapper
prefixes, retention, resume selection) and :mod:`.manager` (the engine part that decides what a
run saves and resumes from)."""
