"""Operating runs on a machine: job plans (launch, stop), monitoring, the environment doctor, checkpoint surgery.

Everything a person does around training rather than in it: plan and start
jobs on the GPUs of a node, watch them, diagnose the host, and convert or
repair checkpoints. May import the tasks, inference and every layer below;
the CLI is its only user above.
"""
