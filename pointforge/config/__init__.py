"""Typed configs: a generic loader for any dataclass, apart from the training run's schema.

* :mod:`pointforge.config.coercion`: a dataclass from plain data and back,
  values coerced to the declared field types, unknown keys answered with a
  close-match suggestion.
* :mod:`pointforge.config.loader`: YAML files, ``key=value`` overrides, deep merge.
* :mod:`pointforge.config.training`: :class:`~pointforge.config.training.TrainConfig`
  and its sections, resolved for one task.

Why hand-written rather than OmegaConf structured configs or pydantic: both
were tried on TrainConfig (issue 13). OmegaConf 2.4 matches most
checks (Literal, did-you-mean, optional sections) but reads ``1e3`` as no
integer, accepts ``nan`` for float options, names a bad key by its class
rather than its dotted path, and loads a config about 50x slower;
pydantic accepts unknown keys unless every class forbids them and its
messages span several lines. Keeping this loader keeps every message and
accepted value as they were; its only extra cost is this code.
"""
