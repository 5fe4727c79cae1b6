"""pointforge's tests; a package so that ``tests.helpers`` imports the same way in pytest and in child processes."""
