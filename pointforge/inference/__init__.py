"""Using trained networks: load a checkpoint, run the network (one layer above the tasks)."""
