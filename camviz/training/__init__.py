"""Maps while a model trains: a probe batch explained every few steps, without changing the run.

:class:`~camviz.training.tracker.Tracker` is the entry point (``camviz.Tracker``); the
Lightning callback (:mod:`camviz.integrations.lightning`) drives the same tracker.
"""

__all__: list[str] = []
